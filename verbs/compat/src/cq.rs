//! Completion queues and completion channels: `ibv_create_cq`,
//! `ibv_destroy_cq`, the context's `ops.poll_cq` and `ops.req_notify_cq`,
//! `ibv_create_comp_channel`, `ibv_destroy_comp_channel`,
//! `ibv_get_cq_event` and `ibv_ack_cq_events`.
//!
//! **Polls and arms** go through the plugin's fast path
//! ([`ibal_user::SharedCq`]): no kernel call. A CQ's `ibv_cq` is the front
//! of its slot in the CQ table (`crate::slots`), so a poll or an arm
//! reaches it from the program's pointer with no lock, lookup or
//! allocation.
//!
//! **A completion channel is a real file descriptor**: an `eventfd` in
//! semaphore mode, which programs `poll`, or make `O_NONBLOCK`. Each CQ
//! made on a channel has a thread blocked in the CQ's `WaitCqEvent` (the
//! kernel keeps an event that fires with no wait pending, so none is
//! lost); each event it receives queues the CQ on its channel and adds one
//! to the descriptor. `ibv_get_cq_event` reads one from the descriptor
//! (blocking, or `EAGAIN` when the program made it non-blocking) and takes
//! the oldest queued CQ. As in rdma-core, `ibv_destroy_cq` drops the CQ's
//! events not yet taken and waits until every event taken was
//! acknowledged (`ibv_ack_cq_events`); a dropped event leaves one count
//! in the descriptor, which a later `ibv_get_cq_event` reads and skips.

use std::collections::VecDeque;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;

use ib_types::wc::{WcFlags, WorkCompletion};
use ibal_user::{ArmFor, SharedCq};
use ibverbs_abi::{
    IBV_WC_GRH, IBV_WC_WITH_IMM, IBV_WC_WITH_INV, IbvCompChannel, IbvContext, IbvCq, IbvWc,
};

use crate::async_events::ObjectKind;
use crate::device::open_context;
use crate::event_fd::EventFd;
use crate::memory::{Registry, remember};
use crate::slots::{Lease, Table};
use crate::state::Context;
use crate::util::{errno_of, guard, lock, set_errno};

/// A completion channel: rdma-core's `ibv_comp_channel` first (its `fd`
/// the eventfd), then the CQs whose events wait to be taken.
#[repr(C)]
pub(crate) struct CompChannel {
    raw: IbvCompChannel,
    fd: EventFd,
    /// The addresses of the CQs whose events were not taken yet, oldest
    /// first (one entry per event).
    queue: Mutex<VecDeque<usize>>,
    /// CQs made on it and not destroyed: destroying it is `EBUSY` meanwhile.
    cqs: AtomicUsize,
    _context: Arc<Context>,
}

// SAFETY: `raw.context` points into `_context` (held), never written after
// the channel is built; the rest is `Send + Sync`.
unsafe impl Send for CompChannel {}
// SAFETY: as for `Send`: shared references only read `raw`.
unsafe impl Sync for CompChannel {}

impl CompChannel {
    /// Queues one event of the CQ at `cq` and wakes a reader.
    fn signal(&self, cq: usize) {
        lock(&self.queue).push_back(cq);
        self.fd.post_one("a completion channel's eventfd");
    }
}

/// How many events of a CQ `ibv_get_cq_event` handed out and how many the
/// program acknowledged.
#[derive(Default)]
struct EventCounts {
    delivered: u64,
    acked: u64,
}

/// A completion queue: rdma-core's `ibv_cq` first, then the access
/// library's CQ, its channel and the thread waiting for its events.
pub(crate) struct CompletionQueue {
    /// Its slot in [`CQS`], where the program's `ibv_cq` is.
    raw: Lease<IbvCq, CompletionQueue>,
    pub(crate) cq: Arc<SharedCq>,
    channel: Option<Arc<CompChannel>>,
    events: Mutex<EventCounts>,
    acked: Condvar,
    waiter: Mutex<Option<JoinHandle<()>>>,
    /// QPs completing on it and not destroyed: destroying it is `EBUSY`.
    pub(crate) children: AtomicUsize,
    context: Arc<Context>,
}

// SAFETY: `raw`'s pointers name the context and channel this CQ holds and
// the program's `cq_context` (never dereferenced); `raw` is never written
// after the CQ is built (its pthread mutex and condition are unused).
unsafe impl Send for CompletionQueue {}
// SAFETY: as for `Send`: shared references only read `raw`.
unsafe impl Sync for CompletionQueue {}

impl CompletionQueue {
    pub(crate) fn as_ptr(&self) -> *mut IbvCq {
        self.raw.get()
    }

    /// The program's `cq_context`, handed back with its events.
    fn cq_context(&self) -> *mut c_void {
        // SAFETY: the slot's `ibv_cq`, written when it was reserved and
        // never after.
        unsafe { (*self.raw.get()).cq_context }
    }
}

static CHANNELS: Registry<CompChannel> = Mutex::new(None);
/// The live CQs, found by the `ibv_cq` pointer ([`crate::slots`]).
static CQS: Table<IbvCq, CompletionQueue> = Table::new();

fn channel_at(ptr: *const IbvCompChannel) -> Option<Arc<CompChannel>> {
    lock(&CHANNELS).as_ref()?.get(&(ptr as usize)).cloned()
}

/// The CQ `ptr` names, if it is one of ours.
pub(crate) fn cq_at(ptr: *const IbvCq) -> Option<Arc<CompletionQueue>> {
    CQS.get(ptr)
}

/// `ibv_create_comp_channel(context)`: a channel whose `fd` is a fresh
/// eventfd; NULL with `errno` (`EINVAL` for a context that is not open,
/// the eventfd's error).
///
/// # Safety
///
/// None beyond C's: the pointer is checked against the open contexts.
pub unsafe extern "C" fn ibv_create_comp_channel(context: *mut IbvContext) -> *mut IbvCompChannel {
    guard(std::ptr::null_mut(), || {
        let context = match open_context(context) {
            Ok(context) => context,
            Err(errno) => {
                set_errno(errno);
                return std::ptr::null_mut();
            }
        };
        let fd = match EventFd::new() {
            Ok(fd) => fd,
            Err(errno) => {
                set_errno(errno);
                return std::ptr::null_mut();
            }
        };
        let channel = Arc::new(CompChannel {
            raw: IbvCompChannel {
                context: context.as_ptr(),
                fd: fd.raw_fd(),
                refcnt: 0,
            },
            fd,
            queue: Mutex::new(VecDeque::new()),
            cqs: AtomicUsize::new(0),
            _context: context,
        });
        let ptr = std::ptr::from_ref(&channel.raw).cast_mut();
        remember(&CHANNELS, ptr as usize, channel);
        ptr
    })
}

/// `ibv_destroy_comp_channel(channel)`: closes its descriptor. 0, or an
/// errno value: `EINVAL` for a channel that is not ours, `EBUSY` while CQs
/// made on it remain.
///
/// # Safety
///
/// None beyond C's: the pointer is checked against the live channels.
pub unsafe extern "C" fn ibv_destroy_comp_channel(channel: *mut IbvCompChannel) -> c_int {
    guard(libc::EIO, || {
        let mut channels = lock(&CHANNELS);
        let Some(map) = channels.as_mut() else {
            return libc::EINVAL;
        };
        match map.get(&(channel as usize)) {
            None => libc::EINVAL,
            Some(found) if found.cqs.load(Ordering::Acquire) != 0 => libc::EBUSY,
            Some(_) => {
                map.remove(&(channel as usize));
                0
            }
        }
    })
}

/// `ibv_create_cq(context, cqe, cq_context, channel, comp_vector)`: a CQ of
/// at least `cqe` entries (`CreateCq`), its completion events on
/// `channel` if not NULL; NULL with `errno`: `EINVAL` for a context that
/// is not open, a channel that is not ours or of another context, `cqe`
/// below 1, `comp_vector` past `num_comp_vectors`; the kernel's answer
/// (e.g. too many entries) otherwise.
///
/// # Safety
///
/// None beyond C's: the pointers are checked against the live objects;
/// `cq_context` is only handed back.
pub unsafe extern "C" fn ibv_create_cq(
    context: *mut IbvContext,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut IbvCompChannel,
    comp_vector: c_int,
) -> *mut IbvCq {
    guard(std::ptr::null_mut(), || {
        match create_cq(context, cqe, cq_context, channel, comp_vector) {
            Ok(ptr) => ptr,
            Err(errno) => {
                set_errno(errno);
                std::ptr::null_mut()
            }
        }
    })
}

fn create_cq(
    context: *mut IbvContext,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut IbvCompChannel,
    comp_vector: c_int,
) -> Result<*mut IbvCq, c_int> {
    let context = open_context(context)?;
    let cqe = u32::try_from(cqe)
        .ok()
        .filter(|&n| n > 0)
        .ok_or(libc::EINVAL)?;
    if comp_vector < 0 || comp_vector >= context.verbs.context.num_comp_vectors {
        return Err(libc::EINVAL);
    }
    let channel = if channel.is_null() {
        None
    } else {
        let found = channel_at(channel).ok_or(libc::EINVAL)?;
        if found.raw.context != context.as_ptr() {
            return Err(libc::EINVAL);
        }
        Some(found)
    };
    let cq = SharedCq::new(Arc::clone(&context.ca), cqe, comp_vector as u32)
        .map_err(|error| errno_of(&error))?;
    let cq = Arc::new(cq);
    let raw = CQS
        .reserve(IbvCq {
            context: context.as_ptr(),
            channel: channel.as_ref().map_or(std::ptr::null_mut(), |c| {
                std::ptr::from_ref(&c.raw).cast_mut()
            }),
            cq_context,
            handle: crate::memory::truncated_handle(cq.handle()),
            cqe: c_int::try_from(cq.cqe()).unwrap_or(c_int::MAX),
            mutex: Default::default(),
            cond: Default::default(),
            comp_events_completed: 0,
            async_events_completed: 0,
        })
        // Dropping the CQ destroys it.
        .ok_or(libc::ENOMEM)?;
    let made = Arc::new(CompletionQueue {
        raw,
        cq: Arc::clone(&cq),
        channel: channel.clone(),
        events: Mutex::new(EventCounts::default()),
        acked: Condvar::new(),
        waiter: Mutex::new(None),
        children: AtomicUsize::new(0),
        context,
    });
    let ptr = made.as_ptr();
    if let Some(channel) = channel {
        channel.cqs.fetch_add(1, Ordering::AcqRel);
        let address = ptr as usize;
        let waiting = std::thread::Builder::new()
            .name("ibv-cq-events".into())
            .spawn(move || {
                // Ends when the wait fails: the CQ destroyed (`Canceled`),
                // or the process's machine gone.
                while cq.wait_event().is_ok() {
                    channel.signal(address);
                }
            });
        match waiting {
            Ok(handle) => *lock(&made.waiter) = Some(handle),
            Err(_) => {
                let _ = made.cq.destroy();
                if let Some(channel) = &made.channel {
                    channel.cqs.fetch_sub(1, Ordering::AcqRel);
                }
                return Err(libc::ENOMEM);
            }
        }
    }
    made.context
        .events
        .track(ObjectKind::Cq, made.cq.handle(), ptr as usize);
    CQS.publish(&made.raw, Arc::clone(&made));
    Ok(ptr)
}

/// `ibv_destroy_cq(cq)`: `DestroyCq`, then, as rdma-core, waits until every
/// completion event `ibv_get_cq_event` and every asynchronous event
/// `ibv_get_async_event` returned for it was acknowledged (its events not
/// yet taken are dropped). 0, or an errno value: `EINVAL`
/// for a CQ that is not ours (or a second destroy), `EBUSY` while QPs
/// complete on it, the kernel's refusal (the CQ stays) otherwise.
///
/// # Safety
///
/// None beyond C's: the pointer is checked against the live CQs.
pub unsafe extern "C" fn ibv_destroy_cq(cq: *mut IbvCq) -> c_int {
    guard(libc::EIO, || {
        let Some(found) = cq_at(cq) else {
            return libc::EINVAL;
        };
        if found.children.load(Ordering::Acquire) != 0 {
            return libc::EBUSY;
        }
        if let Err(error) = found.cq.destroy() {
            return errno_of(&error);
        }
        // The kernel ended the thread's wait.
        if let Some(waiter) = lock(&found.waiter).take() {
            let _ = waiter.join();
        }
        if let Some(channel) = &found.channel {
            lock(&channel.queue).retain(|&queued| queued != cq as usize);
        }
        // Still live meanwhile, so other threads' acks find it.
        let mut events = lock(&found.events);
        while events.acked < events.delivered {
            events = found
                .acked
                .wait(events)
                .unwrap_or_else(PoisonError::into_inner);
        }
        drop(events);
        found.context.events.forget(cq as usize);
        // Waits for the polls inside it; every later one is refused.
        drop(CQS.take(cq));
        if let Some(channel) = &found.channel {
            channel.cqs.fetch_sub(1, Ordering::AcqRel);
        }
        0
    })
}

/// `ibv_get_cq_event(channel, cq, cq_context)`: the next completion event
/// on `channel`: reads one from its descriptor (blocking unless the
/// program made it `O_NONBLOCK`: then -1 with `EAGAIN` when none is
/// there) and answers the CQ and its `cq_context`. 0, or -1 with `errno`
/// (`EINVAL` for a channel that is not ours or NULL out-pointers).
///
/// # Safety
///
/// `cq` and `cq_context` are NULL or valid for writes.
pub unsafe extern "C" fn ibv_get_cq_event(
    channel: *mut IbvCompChannel,
    cq: *mut *mut IbvCq,
    cq_context: *mut *mut c_void,
) -> c_int {
    guard(-1, || {
        let Some(channel) = channel_at(channel).filter(|_| !cq.is_null() && !cq_context.is_null())
        else {
            set_errno(libc::EINVAL);
            return -1;
        };
        // None: the count of an event a destroyed CQ dropped (skipped).
        let taken = channel.fd.take(|| {
            let address = lock(&channel.queue).pop_front()?;
            let found = cq_at(address as *const IbvCq)?;
            lock(&found.events).delivered += 1;
            Some(found)
        });
        match taken {
            Ok(found) => {
                // SAFETY: non-NULL (checked above) and valid for writes
                // (the contract).
                unsafe { *cq = found.as_ptr() };
                // SAFETY: as `cq`.
                unsafe { *cq_context = found.cq_context() };
                0
            }
            Err(errno) => {
                // The read's (EAGAIN on a non-blocking channel).
                set_errno(errno);
                -1
            }
        }
    })
}

/// `ibv_ack_cq_events(cq, nevents)`: acknowledges `nevents` events
/// `ibv_get_cq_event` returned for `cq` (what `ibv_destroy_cq` waits for).
/// A CQ that is not ours is ignored (the verb returns nothing).
///
/// # Safety
///
/// None beyond C's: the pointer is checked against the live CQs.
pub unsafe extern "C" fn ibv_ack_cq_events(cq: *mut IbvCq, nevents: u32) {
    guard((), || {
        if let Some(found) = cq_at(cq) {
            lock(&found.events).acked += u64::from(nevents);
            found.acked.notify_all();
        }
    });
}

/// rdma-core's completion from ours: the codes of status and opcode are
/// IBA's in both; the flags differ.
fn ibv_wc(wc: &WorkCompletion) -> IbvWc {
    let mut wc_flags = 0;
    if wc.flags.contains(WcFlags::GRH) {
        wc_flags |= IBV_WC_GRH;
    }
    if wc.flags.contains(WcFlags::WITH_IMM) {
        wc_flags |= IBV_WC_WITH_IMM;
    }
    if wc.flags.contains(WcFlags::WITH_INVALIDATE) {
        wc_flags |= IBV_WC_WITH_INV;
    }
    IbvWc {
        wr_id: wc.wr_id,
        status: u32::from(wc.status.code()),
        opcode: u32::from(wc.opcode.code()),
        vendor_err: wc.vendor_err,
        byte_len: wc.byte_len,
        imm_data: wc.imm_or_invalidated_rkey,
        qp_num: wc.qp_num.get(),
        src_qp: wc.src_qp.get(),
        wc_flags,
        pkey_index: wc.pkey_index,
        slid: wc.slid.get(),
        sl: wc.sl,
        dlid_path_bits: wc.dlid_path_bits,
    }
}

/// `ops.poll_cq` (`ibv_poll_cq`): up to `num_entries` completions into
/// `wc`, in user mode, with no lock, lookup or heap allocation on the way
/// (the CQ found by its pointer, [`crate::slots`]): how many, or -1 (a CQ
/// that is not ours or destroyed, a negative count, NULL `wc` with
/// entries asked).
///
/// # Safety
///
/// `wc` is valid for writes of `num_entries` completions.
pub(crate) unsafe extern "C" fn poll_cq(
    cq: *mut IbvCq,
    num_entries: c_int,
    wc: *mut IbvWc,
) -> c_int {
    guard(-1, || {
        let Ok(wanted) = usize::try_from(num_entries) else {
            return -1;
        };
        // SAFETY: the contract, passed on.
        let polled = CQS.with(cq, |found| unsafe { poll_into(found, wanted, wc) });
        polled.unwrap_or(-1)
    })
}

/// [`poll_cq`] on a live CQ.
///
/// # Safety
///
/// As [`poll_cq`]'s, `wanted` its `num_entries`.
unsafe fn poll_into(found: &CompletionQueue, wanted: usize, wc: *mut IbvWc) -> c_int {
    if wanted == 0 {
        return 0;
    }
    if wc.is_null() {
        return -1;
    }
    // SAFETY: the caller gave `wanted` entries at `wc`.
    let out = unsafe { std::slice::from_raw_parts_mut(wc, wanted) };
    // A poll of one (latency tools) fills a one-entry batch rather than
    // initialise sixteen.
    if wanted == 1 {
        poll_batches::<1>(found, out)
    } else {
        poll_batches::<16>(found, out)
    }
}

/// Polls into `out`, `BATCH` of our completions at a time: how many, or -1
/// when the first poll fails.
fn poll_batches<const BATCH: usize>(found: &CompletionQueue, out: &mut [IbvWc]) -> c_int {
    let wanted = out.len();
    let mut batch = [WorkCompletion::EMPTY; BATCH];
    let mut filled = 0;
    while filled < wanted {
        let ask = (wanted - filled).min(BATCH);
        let Ok(polled) = found.cq.poll(&mut batch[..ask]) else {
            return if filled == 0 { -1 } else { filled as c_int };
        };
        for (slot, one) in out[filled..].iter_mut().zip(&batch[..polled]) {
            *slot = ibv_wc(one);
        }
        filled += polled;
        if polled < ask {
            break;
        }
    }
    filled as c_int
}

/// `ops.req_notify_cq` (`ibv_req_notify_cq`): arms the CQ for its next
/// completion (solicited only if `solicited_only`), in user mode, found
/// as [`poll_cq`] finds it. 0, or an errno value (`EINVAL` for a CQ that
/// is not ours or destroyed).
///
/// # Safety
///
/// None beyond C's: the pointer is checked against the live CQs.
pub(crate) unsafe extern "C" fn req_notify_cq(cq: *mut IbvCq, solicited_only: c_int) -> c_int {
    guard(libc::EIO, || {
        let for_ = if solicited_only != 0 {
            ArmFor::Solicited
        } else {
            ArmFor::Next
        };
        let armed = CQS.with(cq, |found| match found.cq.arm(for_) {
            Ok(()) => 0,
            Err(error) => errno_of(&error),
        });
        armed.unwrap_or(libc::EINVAL)
    })
}
