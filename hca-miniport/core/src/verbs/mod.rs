//! The verbs framework of the core (guide 4, 6; docs/miniport.md "ci"):
//! one request path for every control verb, the verb state hung on
//! [`Hca`], the passive-level work queue, and the routing of device events
//! to the client that owns the object.
//!
//! Contract:
//! - **One entry.** [`Hca::submit_request`] is the CI's `submit`: it reads
//!   the request's IOCTL code ([`VerbId::from_ioctl`]) and input bytes,
//!   decodes them with [`decode_request`], applies the requestor-mode
//!   policy (kernel-only verbs and inputs, objects of a kernel CA are
//!   invisible to user requests), resolves the target handle through the
//!   generation-checked tables, runs the verb and completes the request
//!   exactly once with an [`encode_response`] answer. Bad framing, an
//!   unknown code, a stale or wrong-kind handle: a clear status, nothing
//!   changed, never a panic.
//! - **Completion.** A request is completed with the NTSTATUS of the
//!   response's [`IbStatus`] ([`IbStatus::to_ntstatus`], injective) and
//!   `information` = the response bytes written. An unknown IOCTL code gets
//!   `STATUS_INVALID_DEVICE_REQUEST` and an output buffer too small for the
//!   verb's header and fixed output `STATUS_BUFFER_TOO_SMALL`, both with
//!   nothing written (there is no verb, or no room, to answer in).
//! - **Never blocks.** A verb that needs device commands submits them with
//!   [`Hca::submit`] and completes its request from the continuation (the
//!   DPC). A verb that needs a DMA common buffer (whose allocation and
//!   freeing are PASSIVE_LEVEL only, `AllocateCommonBuffer`) queues a job
//!   for the device's work item ([`Hca::work_item`]) and continues from
//!   there. So every verb may be issued at DISPATCH_LEVEL. PASSIVE_LEVEL
//!   callers that want to wait use the CI's synchronous wrapper
//!   (`crate::ci::CiProvider::submit_and_wait`, on a platform event).
//! - **Events.** The DPC hands every device event to the verbs first
//!   (`VerbsRouter`): `COMPLETION` and `CQ_ERROR` go, by CQ number, to the
//!   client of the CA that owns the CQ *now* (a CQ's number is freed only
//!   when its `HW2SW_CQ` completion is processed, and the core's one EQ
//!   orders every event of the CQ before that completion, so no event
//!   reaches a stale owner); `SRQ_LIMIT` and `SRQ_CATASTROPHIC` go the
//!   same way, by SRQ number, as asynchronous events ([`srq`]); QP events
//!   (PRM 8.2: `COMM_EST`, `SQ_DRAINED`, `PATH_MIGRATED`, `QP_FATAL`,
//!   `WQ_INVALID_REQUEST`, `WQ_ACCESS_ERROR`, `SRQ_LAST_WQE`) by QP number
//!   to the live QP only (a destroyed QP kept for its late completions'
//!   `wr_id`s gets none), first into its cached state ([`qp`]), then as
//!   asynchronous events; port changes (`PortActive`, `PortDown`) and
//!   P_Key and Q_Key violations (`PKEY_VIOLATION`, `QKEY_VIOLATION`, as
//!   the guide's Table 6-3 traps `PkeyTrap`, `QkeyTrap`), each naming the
//!   port, go to the kernel client and to every user context ([`user`]). Every event is also
//!   passed on to the sink given to [`Hca::new`]. Client callbacks run from
//!   the DPC with no core lock held.
//! - **State.** The object tables are built from the [`BringUpReport`] on
//!   first use and dropped at [`Hca::stop`], which frees every verb-owned
//!   common buffer after the device no longer owns memory. Verbs in flight
//!   at a stop complete with an error: their commands fail when the
//!   command interface leaves event mode, and a passive job that runs
//!   after the stop answers [`IbStatus::InvalidState`]. (A passive job
//!   running on another thread *during* a stop is not fenced yet.)
//! - **Locks.** The object tables are behind a reader-writer spin lock
//!   (`driver_platform::RwSpinLock`, `EX_SPIN_LOCK` on Windows): lookups
//!   take it shared (`Hca::with_objects`: post, poll, `wr_id`
//!   resolution, event routing, every handle check), and only what
//!   changes the tables takes it exclusive (`Hca::with_objects_mut`:
//!   creates, destroys, uses taken and dropped, state kept in the tables),
//!   so lookups never wait for each other. Order: the object tables (in
//!   either mode), then an object's own lock (a CQ's ring, an SRQ's ring,
//!   a QP's control and ring locks, the MTT allocator's), never the other
//!   way round. The tables are never acquired again while held, in any
//!   mode: exclusive after shared on one thread deadlocks on Windows, and
//!   shared after shared can too, behind a waiting exclusive acquirer;
//!   there is no upgrade (a lookup that needs a change releases and
//!   takes the tables exclusive, then looks again). No core lock is held
//!   while a client callback or a command continuation runs.
//!
//! - **Power and failure.** The objects outlive a D0 exit and come back
//!   on D0 entry ([`restore`]); while below D0 every verb answers
//!   [`IbStatus::InvalidState`]. After a device failure only the verbs that
//!   free something run, and software completes what the device cannot
//!   ([`fatal`]).
//!
//! Verbs implemented here: CA ([`ca`]), PD ([`pd`]), CQ ([`cq`]), AV
//! ([`av`]), SRQ ([`srq`]), kernel QPs ([`qp`]), memory regions
//! ([`region`]), memory windows ([`mw`]), multicast ([`mcast`]), local MAD
//! ([`mad`]), and user-mode contexts with their CQs, QPs and SRQs in user
//! memory through [`Hca::submit_user_request`] ([`user`]); every other verb
//! answers [`IbStatus::Unsupported`].
//!
//! **Caller context.** One mechanism: a user-mode request carries the
//! process it came from (`driver_platform::CallerProcess`) into
//! [`Hca::prepare_user_request`], in that process's context at
//! PASSIVE_LEVEL (the shell's `EvtIoInCallerContext`, before the queue);
//! everything that reaches into the process (locking its pages for rings
//! and regions, mapping or unmapping its doorbell page) happens there, and
//! [`Hca::execute_user_request`] runs the verb wherever the queue delivers
//! it with only what that produced ([`caller`]). Kernel requests
//! enter through [`Hca::submit_request`] at any IRQL up to DISPATCH_LEVEL
//! without one, and kernel registrations lock with the locker installed
//! with [`Hca::set_kernel_locker`]. A user request without its caller
//! reaches nothing of a user context and registers nothing.
//!
//! [`BringUpReport`]: crate::init::BringUpReport

pub mod av;
pub mod ca;
pub mod caller;
pub mod cq;
pub mod fatal;
pub mod mad;
pub mod mcast;
pub mod mw;
mod objects;
pub mod pd;
pub mod qp;
pub mod region;
pub mod restore;
pub mod srq;
pub mod user;

use alloc::boxed::Box;
use alloc::collections::VecDeque;
use alloc::sync::{Arc, Weak};
use alloc::vec::Vec;
use core::marker::PhantomData;
use core::sync::atomic::{AtomicU32, Ordering};

use driver_platform::{
    Deferred, DmaAdapter, NtStatus, Platform, Request, RequestorMode, RwSpinLock,
    RwSpinLockReadGuard, SpinLock,
};
use ib_types::event::AsyncEventRecord;
use ib_types::handle::CqHandle;
use ib_types::ioctl::{
    IoctlCode, RESPONSE_HEADER_SIZE, Verb, VerbId, decode_request, encode_response,
};
use ib_types::scalars::{PortNum, Qpn};
use ib_types::status::IbStatus;

use crate::cmd::{Command, CommandError, CommandOutput};
use crate::eq::{DeviceFailure, EventSink, PortViolation, QpEvent, SrqEvent};
use crate::hca::Hca;
use crate::init::BringUpReport;
use crate::mr::MemoryTranslation;
use crate::resources::{ObjectTable, QpTable, QpnAllocator, kind};

pub use ca::{CaClient, UVP_NAME};
pub use caller::{CallerLocks, PreparedUserRequest};
pub use cq::{CqNotify, poll_and_rearm};

/// `STATUS_BUFFER_TOO_SMALL`: the output buffer cannot hold the verb's
/// response header and fixed output.
pub const STATUS_BUFFER_TOO_SMALL: NtStatus = NtStatus::from_raw(0xC000_0023);

/// Protection domains the core hands out (PD numbers are 24-bit in the
/// contexts; this bounds the table's memory).
pub const MAX_PDS: u32 = 1 << 14;

pub(crate) type Buffer<P> = <<P as Platform>::Dma as DmaAdapter>::Buffer;

/// What runs after a sequence of commands ([`Hca::run_commands`]): their
/// outputs, or the first error.
pub(crate) type Sequel<P> =
    Box<dyn FnOnce(&Arc<Hca<P>>, Result<Vec<CommandOutput>, CommandError>) + Send>;

/// What runs when a destroy (or another step without output) ends.
pub(crate) type Done<P> = Box<dyn FnOnce(&Arc<Hca<P>>, Result<(), IbStatus>) + Send>;

/// Work that must run at PASSIVE_LEVEL (common-buffer allocation).
type Job<P> = Box<dyn FnOnce(&Arc<Hca<P>>) + Send>;

/// The open CA (guide 6.1.1: one open at a time).
struct OpenCa {
    /// The handle handed out: `generation << 32 | 0xCA`.
    handle: u64,
    /// Who opened it; a user request never sees a kernel CA's objects.
    mode: RequestorMode,
    /// The client's callbacks, if it registered any.
    client: Option<Arc<dyn CaClient>>,
}

/// The verb objects of one started device.
pub(crate) struct Objects<P: Platform> {
    ca: Option<OpenCa>,
    ca_generation: u32,
    pub(crate) pds: ObjectTable<kind::Pd, pd::Pd>,
    pub(crate) cqs: ObjectTable<kind::Cq, Arc<cq::Cq<P>>>,
    /// Kernel address vectors (software objects, [`av`]).
    pub(crate) avs: ObjectTable<kind::Av, av::Av>,
    /// Shared receive queues ([`srq`]).
    pub(crate) srqs: ObjectTable<kind::Srq, Arc<srq::Srq<P>>>,
    /// QPs by number (special QPs at their fixed numbers).
    pub(crate) qps: QpTable<Arc<qp::Qp<P>>>,
    /// Memory regions, each at its MPT index ([`region`]).
    pub(crate) mrs: ObjectTable<kind::Mr, region::MrEntry<P>>,
    /// Memory windows, each at its MPT index ([`mw`]).
    pub(crate) mws: ObjectTable<kind::Mw, mw::Mw>,
    /// Multicast memberships ([`mcast`]).
    pub(crate) mcasts: ObjectTable<kind::Mcast, mcast::Membership<P>>,
    /// The memory translation service: MPT keys, and the one MTT
    /// allocator (after the EQ's reserved entries) that CQ rings and
    /// memory regions share.
    pub(crate) mtt: MemoryTranslation<P>,
    /// The EQ completion events go to.
    pub(crate) eqn: u32,
    /// `log2` of the largest CQ.
    pub(crate) log_max_cqes: u8,
    /// User-mode contexts and what they hold ([`user`]).
    pub(crate) user: user::UserContexts<P>,
}

/// The verb state of one [`Hca`].
pub struct Verbs<P: Platform> {
    /// The object tables: shared for lookups, exclusive for changes
    /// ([`Hca::with_objects`], [`Hca::with_objects_mut`]).
    objects: RwSpinLock<P, Option<Objects<P>>>,
    jobs: SpinLock<P, VecDeque<Job<P>>>,
    /// Common buffers the device no longer uses, freed by the work item.
    to_free: SpinLock<P, Vec<Buffer<P>>>,
    /// Client callbacks running now (guide 6.1.4: close waits for them).
    callbacks_in_flight: AtomicU32,
    /// Events software produced for clients, delivered by the DPC
    /// ([`restore`], [`fatal`]).
    soft_events: SpinLock<P, Vec<restore::SoftEvent>>,
    /// Objects D0 entry could not give back to the device (user CQs, QPs
    /// and SRQs, [`restore`]), by raw handle: their destroy frees them
    /// whatever the device answers.
    lost: SpinLock<P, alloc::collections::BTreeSet<u64>>,
    /// The locker for kernel-mode registrations ([`Hca::set_kernel_locker`]).
    kernel_locker: SpinLock<P, Option<Arc<P::Locker>>>,
    /// The QP numbers of the previous life of this device object, every
    /// one still in use then quarantined from its end
    /// ([`QpnAllocator::retire_all`]): the next life's tables start from
    /// it, so a restart reuses no number before its quiet period ended.
    retired_qpns: SpinLock<P, Option<QpnAllocator>>,
}

impl<P: Platform> core::fmt::Debug for Verbs<P> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Verbs").finish_non_exhaustive()
    }
}

impl<P: Platform> Default for Verbs<P> {
    fn default() -> Self {
        Self::new()
    }
}

impl<P: Platform> Verbs<P> {
    /// No objects yet.
    pub fn new() -> Self {
        Self {
            objects: RwSpinLock::<P, _>::new(None),
            jobs: SpinLock::<P, _>::new(VecDeque::new()),
            to_free: SpinLock::<P, _>::new(Vec::new()),
            callbacks_in_flight: AtomicU32::new(0),
            soft_events: SpinLock::<P, _>::new(Vec::new()),
            lost: SpinLock::<P, _>::new(alloc::collections::BTreeSet::new()),
            kernel_locker: SpinLock::<P, _>::new(None),
            retired_qpns: SpinLock::<P, _>::new(None),
        }
    }

    /// Drops every object and hands back every common buffer they held and
    /// every buffer waiting to be freed; memory regions still registered
    /// are released without commands (unmapped, unlocked). Called by
    /// teardown once the device owns no memory any more.
    pub(crate) fn take_buffers(&self, hca: &Hca<P>) -> Vec<Buffer<P>> {
        let objects = self.objects.write().take();
        // Their objects are gone; a later start's must not hear of them.
        self.soft_events.lock().clear();
        self.lost.lock().clear();
        let mut buffers = core::mem::take(&mut *self.to_free.lock());
        if let Some(mut objects) = objects {
            for region in Hca::take_all_regions(&mut objects) {
                objects.mtt.release_after_reset(hca, region);
            }
            for (_, cq) in objects.cqs.iter() {
                buffers.extend(cq.take_buffers());
            }
            for (_, srq) in objects.srqs.iter() {
                buffers.extend(srq.take_buffers());
            }
            for (_, qp) in objects.qps.objects().iter() {
                buffers.extend(qp.take_buffers());
            }
            // Peers may still address the QPs of this life: the next life
            // keeps their numbers quarantined.
            let numbers = objects.qps.retire(hca.deferred.now_ns());
            *self.retired_qpns.lock() = Some(numbers);
        }
        buffers
    }
}

/// Answers one request of verb `V`, exactly once: by
/// [`finish`](Self::finish), or, if dropped unanswered (a continuation that
/// never ran because the device object went away), with
/// [`IbStatus::GenericError`].
pub struct Responder<V: Verb, R: Request> {
    request: Option<R>,
    /// Room for private output: `min(private_out_max, output left)`.
    private_room: usize,
    /// Runs with the answer's status and handle just before the request
    /// is completed ([`before_answer`](Self::before_answer)).
    before_answer: Option<BeforeAnswer>,
    verb: PhantomData<fn() -> V>,
}

/// What a [`Responder`] runs before it answers: the status and handle.
pub(crate) type BeforeAnswer = Box<dyn FnOnce(IbStatus, u64) + Send>;

impl<V: Verb, R: Request> core::fmt::Debug for Responder<V, R> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Responder")
            .field("verb", &V::ID)
            .finish_non_exhaustive()
    }
}

impl<V: Verb, R: Request> Responder<V, R> {
    /// Completes the request with the encoded response.
    pub fn finish(mut self, status: IbStatus, handle: u64, out: Option<&V::Out>, private: &[u8]) {
        if let Some(hook) = self.before_answer.take() {
            hook(status, handle);
        }
        if let Some(request) = self.request.take() {
            complete_request::<V, R>(request, status, handle, out, private);
        }
    }

    /// Completes the request with a failure status (no output, no handle).
    pub fn fail(self, status: IbStatus) {
        self.finish(status, 0, None, &[]);
    }

    /// Has `hook` run with the status and handle of the answer just before
    /// the request completes (also when the responder is dropped
    /// unanswered, with [`IbStatus::GenericError`]): a user context
    /// records what a trusted verb made, or ends an operation it counted,
    /// before its process can see the answer. Called with no core lock
    /// held, like every answer.
    pub(crate) fn before_answer(&mut self, hook: BeforeAnswer) {
        self.before_answer = Some(hook);
    }

    /// Bytes of private output the caller can take.
    pub fn private_room(&self) -> usize {
        self.private_room
    }

    /// True once the issuer asked to cancel the request.
    pub fn is_canceled(&self) -> bool {
        self.request.as_ref().is_some_and(Request::is_canceled)
    }
}

impl<V: Verb<Out = ib_types::ioctl::Empty>, R: Request + 'static> Responder<V, R> {
    /// The [`Done`] of a verb with no output: answers success, or the
    /// failure it is given.
    pub(crate) fn into_done<P: Platform>(self) -> Done<P> {
        Box::new(move |_hca, result| match result {
            Ok(()) => self.finish(IbStatus::Success, 0, Some(&ib_types::ioctl::Empty), &[]),
            Err(status) => self.fail(status),
        })
    }
}

impl<V: Verb, R: Request> Drop for Responder<V, R> {
    fn drop(&mut self) {
        if let Some(hook) = self.before_answer.take() {
            hook(IbStatus::GenericError, 0);
        }
        if let Some(request) = self.request.take() {
            complete_request::<V, R>(request, IbStatus::GenericError, 0, None, &[]);
        }
    }
}

/// Encodes and completes. A response the framing refuses is a core bug; it
/// is answered as [`IbStatus::GenericError`] rather than sent malformed.
fn complete_request<V: Verb, R: Request>(
    mut request: R,
    status: IbStatus,
    handle: u64,
    out: Option<&V::Out>,
    private: &[u8],
) {
    match encode_response::<V>(status, handle, out, private, request.output()) {
        Ok(len) => request.complete(status.to_ntstatus(), len as u64),
        Err(_) => {
            let generic = IbStatus::GenericError;
            match encode_response::<V>(generic, 0, None, &[], request.output()) {
                Ok(len) => request.complete(generic.to_ntstatus(), len as u64),
                Err(_) => request.complete(STATUS_BUFFER_TOO_SMALL, 0),
            }
        }
    }
}

/// A decoded request: the responder, the header's handle, the fixed input
/// and who issued it.
pub struct Accepted<V: Verb, R: Request> {
    /// Answers the request.
    pub responder: Responder<V, R>,
    /// The request header's handle (the target, see [`VerbId::target`]).
    pub handle: u64,
    /// The fixed input.
    pub input: V::In,
    /// The requestor mode.
    pub mode: RequestorMode,
}

impl<V: Verb, R: Request> core::fmt::Debug for Accepted<V, R> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Accepted")
            .field("verb", &V::ID)
            .field("handle", &self.handle)
            .field("input", &self.input)
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

/// Checks the output room, decodes, and applies the mode policy; answers
/// the request itself (and returns `None`) when any of that fails.
/// Accepts a request for `V` and runs its handler, in a frame of its own.
/// Inlined into [`Hca::dispatch_request`], every verb's locals shared one
/// frame there (10.4 KiB in a release build, on every request's kernel
/// stack); now a request's stack holds only its own verb's.
#[inline(never)]
fn serve<V: Verb, R: Request>(request: R, handler: impl FnOnce(Accepted<V, R>)) {
    if let Some(accepted) = accept::<V, R>(request) {
        handler(accepted);
    }
}

fn accept<V: Verb, R: Request>(mut request: R) -> Option<Accepted<V, R>> {
    let fixed = RESPONSE_HEADER_SIZE + V::ID.out_size();
    let output_len = request.output().len();
    if output_len < fixed {
        request.complete(STATUS_BUFFER_TOO_SMALL, 0);
        return None;
    }
    let mode = request.requestor_mode();
    let decoded = decode_request::<V>(request.input())
        .map(|r| (r.handle, r.input, r.private_out_max, r.kernel_only()));
    let mut responder = Responder::<V, R> {
        request: Some(request),
        private_room: 0,
        before_answer: None,
        verb: PhantomData,
    };
    let Ok((handle, input, private_out_max, kernel_only)) = decoded else {
        responder.fail(IbStatus::InvalidParameter);
        return None;
    };
    if kernel_only && mode == RequestorMode::User {
        responder.fail(IbStatus::InvalidPermission);
        return None;
    }
    responder.private_room = (output_len - fixed).min(private_out_max as usize);
    Some(Accepted {
        responder,
        handle,
        input,
        mode,
    })
}

/// Answers a verb this core does not implement yet.
fn unsupported<V: Verb, R: Request>(request: R) {
    if let Some(accepted) = accept::<V, R>(request) {
        accepted.responder.fail(IbStatus::Unsupported);
    }
}

/// What the shells' `EvtIoStop` does with a request the core holds when
/// the device leaves D0 (KMDF waits, before D0 exit, until each is
/// completed or acknowledged).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnQueueStop {
    /// A wait (`WaitCqEvent`, `GetAsyncEvent`): it pends until an event,
    /// which may come long after the device left D0, and touches no
    /// hardware meanwhile, so it is acknowledged and stays with the core
    /// (`WdfRequestStopAcknowledge`, no requeue); nothing to do on resume.
    KeepPending,
    /// Any other verb: it completes on its own in bounded time (its
    /// commands and passive jobs finish while the device is still in D0),
    /// so the queue waits for it.
    LetFinish,
}

/// How a request with I/O control code `ioctl` is treated when its queue
/// stops (see [`OnQueueStop`]).
pub fn on_queue_stop(ioctl: u32) -> OnQueueStop {
    match VerbId::from_ioctl(IoctlCode::from_raw(ioctl)) {
        Ok(VerbId::WaitCqEvent | VerbId::GetAsyncEvent) => OnQueueStop::KeepPending,
        _ => OnQueueStop::LetFinish,
    }
}

impl<P: Platform> Hca<P>
where
    P::Request: 'static,
{
    /// The CI's `submit` entry point: runs one verb request (see the module
    /// doc). Callable at DISPATCH_LEVEL or below; never blocks. The request
    /// is completed exactly once, possibly before this returns, possibly
    /// later from the DPC or the work item.
    pub fn submit_request(self: &Arc<Self>, request: P::Request) {
        self.dispatch_request(request);
    }

    /// Decodes and runs one request without a caller process (a kernel
    /// request, or a user request whose process the shell did not give).
    fn dispatch_request(self: &Arc<Self>, request: P::Request) {
        use ib_types::ioctl as v;
        let code = IoctlCode::from_raw(request.ioctl_code());
        let Ok(verb) = VerbId::from_ioctl(code) else {
            request.complete(NtStatus::INVALID_DEVICE_REQUEST, 0);
            return;
        };
        // Below D0 or after a device failure (restore.rs, fatal.rs).
        if let Err(status) = self.admit(verb) {
            fatal::refuse_request(request, verb, status);
            return;
        }
        // A kernel client never reaches a user context's objects (user.rs).
        if let Err(status) = self.refuse_user_targets(verb, request.input()) {
            fatal::refuse_request(request, verb, status);
            return;
        }
        type R<P> = <P as Platform>::Request;
        match verb {
            VerbId::OpenCa => serve::<v::OpenCa, R<P>>(request, |a| self.open_ca_request(a)),
            VerbId::CloseCa => serve::<v::CloseCa, R<P>>(request, |a| self.close_ca_request(a)),
            VerbId::QueryCa => serve::<v::QueryCa, R<P>>(request, |a| self.query_ca_request(a)),
            VerbId::ModifyCa => serve::<v::ModifyCa, R<P>>(request, |a| self.modify_ca_request(a)),
            VerbId::AllocPd => serve::<v::AllocPd, R<P>>(request, |a| self.alloc_pd_request(a)),
            VerbId::DeallocPd => {
                serve::<v::DeallocPd, R<P>>(request, |a| self.dealloc_pd_request(a))
            }
            VerbId::CreateCq => serve::<v::CreateCq, R<P>>(request, |a| self.create_cq_request(a)),
            VerbId::QueryCq => serve::<v::QueryCq, R<P>>(request, |a| self.query_cq_request(a)),
            VerbId::ResizeCq => serve::<v::ResizeCq, R<P>>(request, |a| self.resize_cq_request(a)),
            VerbId::DestroyCq => {
                serve::<v::DestroyCq, R<P>>(request, |a| self.destroy_cq_request(a))
            }
            VerbId::CreateAv => serve::<v::CreateAv, R<P>>(request, |a| self.create_av_request(a)),
            VerbId::QueryAv => serve::<v::QueryAv, R<P>>(request, |a| self.query_av_request(a)),
            VerbId::ModifyAv => serve::<v::ModifyAv, R<P>>(request, |a| self.modify_av_request(a)),
            VerbId::DestroyAv => {
                serve::<v::DestroyAv, R<P>>(request, |a| self.destroy_av_request(a))
            }
            VerbId::CreateQp => serve::<v::CreateQp, R<P>>(request, |a| self.create_qp_request(a)),
            VerbId::QueryQp => serve::<v::QueryQp, R<P>>(request, |a| self.query_qp_request(a)),
            VerbId::ModifyQp => serve::<v::ModifyQp, R<P>>(request, |a| self.modify_qp_request(a)),
            VerbId::DestroyQp => {
                serve::<v::DestroyQp, R<P>>(request, |a| self.destroy_qp_request(a))
            }
            VerbId::CreateSrq => {
                serve::<v::CreateSrq, R<P>>(request, |a| self.create_srq_request(a))
            }
            VerbId::QuerySrq => serve::<v::QuerySrq, R<P>>(request, |a| self.query_srq_request(a)),
            VerbId::ModifySrq => {
                serve::<v::ModifySrq, R<P>>(request, |a| self.modify_srq_request(a))
            }
            VerbId::DestroySrq => {
                serve::<v::DestroySrq, R<P>>(request, |a| self.destroy_srq_request(a))
            }
            VerbId::RegMr => serve::<v::RegMr, R<P>>(request, |a| self.reg_mr_request(a, None)),
            VerbId::RegSharedMr => {
                serve::<v::RegSharedMr, R<P>>(request, |a| self.reg_shared_mr_request(a))
            }
            VerbId::ReregMr => {
                serve::<v::ReregMr, R<P>>(request, |a| self.rereg_mr_request(a, None))
            }
            VerbId::QueryMr => serve::<v::QueryMr, R<P>>(request, |a| self.query_mr_request(a)),
            VerbId::DeregMr => serve::<v::DeregMr, R<P>>(request, |a| self.dereg_mr_request(a)),
            VerbId::AllocMw => serve::<v::AllocMw, R<P>>(request, |a| self.alloc_mw_request(a)),
            VerbId::QueryMw => serve::<v::QueryMw, R<P>>(request, |a| self.query_mw_request(a)),
            VerbId::DeallocMw => {
                serve::<v::DeallocMw, R<P>>(request, |a| self.dealloc_mw_request(a))
            }
            VerbId::AttachMcast => {
                serve::<v::AttachMcast, R<P>>(request, |a| self.attach_mcast_request(a))
            }
            VerbId::DetachMcast => {
                serve::<v::DetachMcast, R<P>>(request, |a| self.detach_mcast_request(a))
            }
            VerbId::WaitCqEvent => unsupported::<v::WaitCqEvent, R<P>>(request),
            VerbId::GetAsyncEvent => unsupported::<v::GetAsyncEvent, R<P>>(request),
            VerbId::RegPhysMr => {
                serve::<v::RegPhysMr, R<P>>(request, |a| self.reg_phys_mr_request(a))
            }
            VerbId::LocalMad => serve::<v::LocalMad, R<P>>(request, |a| self.local_mad_request(a)),
            VerbId::ReregPhysMr => {
                serve::<v::ReregPhysMr, R<P>>(request, |a| self.rereg_phys_mr_request(a))
            }
        }
    }
}

impl<P: Platform> Hca<P> {
    /// The work item's entry point, at PASSIVE_LEVEL: runs the queued
    /// passive jobs (common-buffer allocations of CQ creation and resize)
    /// and frees the common buffers the device gave back.
    pub fn work_item(self: &Arc<Self>) {
        loop {
            let job = self.verbs.jobs.lock().pop_front();
            let Some(job) = job else { break };
            job(self);
        }
        let buffers = core::mem::take(&mut *self.verbs.to_free.lock());
        for buffer in buffers {
            (self.free_common)(&self.dma, buffer);
        }
    }

    /// Queues `job` for the work item.
    pub(crate) fn queue_passive(&self, job: Job<P>) {
        self.verbs.jobs.lock().push_back(job);
        self.deferred.queue_work_item();
    }

    /// Queues common buffers for freeing by the work item (`FreeCommonBuffer`
    /// is PASSIVE_LEVEL only).
    pub(crate) fn free_later(&self, buffers: impl IntoIterator<Item = Buffer<P>>) {
        let mut queued = false;
        {
            let mut to_free = self.verbs.to_free.lock();
            for buffer in buffers {
                to_free.push(buffer);
                queued = true;
            }
        }
        if queued {
            self.deferred.queue_work_item();
        }
    }

    /// Runs `f` on the verb objects with the object tables held *shared*
    /// (lookups: posters, pollers and every other reader run at once and
    /// wait only for an exclusive holder), building the tables from the
    /// bring-up report on first use. Fails with [`IbStatus::InvalidState`]
    /// while the device is not started.
    #[inline]
    pub(crate) fn with_objects<T>(&self, f: impl FnOnce(&Objects<P>) -> T) -> Result<T, IbStatus> {
        // `f` is called in one place, so the compiler may inline it into
        // the caller (the data path's poll and post).
        let guard = self.objects_shared()?;
        match guard.as_ref() {
            Some(objects) => Ok(f(objects)),
            None => Err(IbStatus::InvalidState),
        }
    }

    /// The object tables held shared, built first on first use.
    #[inline]
    fn objects_shared(&self) -> Result<RwSpinLockReadGuard<'_, P, Option<Objects<P>>>, IbStatus> {
        let guard = self.verbs.objects.read();
        if guard.is_some() {
            return Ok(guard);
        }
        drop(guard);
        self.objects_built_shared()
    }

    /// [`objects_shared`](Self::objects_shared) on first use: builds them
    /// exclusive (no upgrade from shared exists, `EX_SPIN_LOCK`), then
    /// takes them shared again.
    #[cold]
    #[inline(never)]
    fn objects_built_shared(
        &self,
    ) -> Result<RwSpinLockReadGuard<'_, P, Option<Objects<P>>>, IbStatus> {
        self.build_objects()?;
        Ok(self.verbs.objects.read())
    }

    /// Runs `f` with the object tables held shared, as every lookup holds
    /// them, and returns what it returns: for tests showing what a shared
    /// holder does not delay (posting, polling: they take the tables
    /// shared too) and for diagnostics. `f` must not call a verb of this
    /// HCA that changes objects: exclusive after shared on one thread
    /// deadlocks (`driver_platform::Platform::RawRwSpinLock`). Fails with
    /// [`IbStatus::InvalidState`] while the device is not started.
    #[doc(hidden)]
    pub fn hold_object_tables_shared<R>(&self, f: impl FnOnce() -> R) -> Result<R, IbStatus> {
        self.with_objects(|_| f())
    }

    /// Runs `f` on the verb objects with the object tables held
    /// *exclusive*: creates, destroys and every change of what the tables
    /// hold. Builds them on first use like [`Self::with_objects`].
    pub(crate) fn with_objects_mut<T>(
        &self,
        f: impl FnOnce(&mut Objects<P>) -> T,
    ) -> Result<T, IbStatus> {
        self.build_objects()?;
        self.verbs
            .objects
            .write()
            .as_mut()
            .map(f)
            .ok_or(IbStatus::InvalidState)
    }

    /// Builds the object tables from the bring-up report unless they exist.
    fn build_objects(&self) -> Result<(), IbStatus> {
        if self.verbs.objects.read().is_some() {
            return Ok(());
        }
        let mut guard = self.verbs.objects.write();
        if guard.is_none() {
            let report = self.report().ok_or(IbStatus::InvalidState)?;
            let cqs = 1u32 << report.table(hca_prm::cmd::Table::Cqc).log_count;
            let srqs = 1u32 << report.table(hca_prm::cmd::Table::Srqc).log_count;
            let mtt = MemoryTranslation::new(&report).map_err(|e| e.ib_status())?;
            // Regions and windows are stored at their MPT index (24 bits
            // at most, `MAX_OBJECTS`).
            let mpts = 1u32
                .checked_shl(u32::from(report.table(hca_prm::cmd::Table::Mpt).log_count))
                .unwrap_or(u32::MAX)
                .min(crate::resources::MAX_OBJECTS);
            // Handles of this life start past every earlier life's
            // (`resources::life_generation`): a client's stale handle never
            // names a new object.
            let first = crate::resources::life_generation(self.deferred.now_ns());
            fn table<K: crate::resources::ObjectKind, T>(
                capacity: u32,
                first: u32,
            ) -> Result<ObjectTable<K, T>, IbStatus> {
                ObjectTable::from_generation(capacity, 0..0, first)
                    .map_err(|_| IbStatus::InvalidState)
            }
            *guard = Some(Objects {
                ca: None,
                ca_generation: first.wrapping_sub(1),
                pds: table(MAX_PDS, first)?,
                cqs: table(cqs, first)?,
                avs: table(av::MAX_AVS, first)?,
                srqs: table(srqs, first)?,
                qps: QpTable::with_numbers_from_generation(self.next_life_qpns(&report)?, first)
                    .map_err(|_| IbStatus::InvalidState)?,
                mrs: table(mpts, first)?,
                mws: table(mpts, first)?,
                mcasts: table(mcast::MAX_MEMBERSHIPS, first)?,
                mtt,
                eqn: report.eqn,
                log_max_cqes: report.capabilities.log_max_cqes,
                user: user::UserContexts::new(report.capabilities.num_uars.get().into(), first),
            });
        }
        Ok(())
    }

    /// The QP numbering of a life that begins: the previous life's, if this
    /// device object had one of the same shape (no number reused before
    /// its quiet period ended), else a fresh one starting at a point drawn
    /// from the time ([`crate::resources::rotation_start`]: a predecessor
    /// device object's numbers are only probably avoided).
    fn next_life_qpns(&self, report: &BringUpReport) -> Result<QpnAllocator, IbStatus> {
        let capacity = 1u32 << report.table(hca_prm::cmd::Table::Qpc).log_count;
        let num_ports = report.capabilities.num_ports;
        if let Some(previous) = self.verbs.retired_qpns.lock().take()
            && previous.capacity() == capacity
            && previous.num_ports() == num_ports
        {
            return Ok(previous);
        }
        QpnAllocator::starting_at(
            capacity,
            num_ports,
            qp::QPN_QUIET_PERIOD_NS,
            crate::resources::rotation_start(self.deferred.now_ns()),
        )
        .map_err(|_| IbStatus::InvalidState)
    }

    /// Checks that `handle` is the open CA and visible to `mode`.
    pub(crate) fn check_ca(&self, handle: u64, mode: RequestorMode) -> Result<(), IbStatus> {
        self.with_objects(|o| match &o.ca {
            Some(ca) if ca.handle == handle && visible(ca.mode, mode) => Ok(()),
            _ => Err(IbStatus::InvalidCaHandle),
        })?
    }

    /// Whether objects of the open CA are visible to `mode`. Kernel
    /// requests also see objects while user contexts are open (user
    /// requests reach them only after [`user`]'s ownership check, as
    /// trusted requests).
    pub(crate) fn ca_visible(objects: &Objects<P>, mode: RequestorMode) -> bool {
        objects.ca.as_ref().is_some_and(|ca| visible(ca.mode, mode))
            || (mode == RequestorMode::Kernel && !objects.user.is_empty())
    }

    /// Runs `commands` one after another (each only after the previous
    /// succeeded), then `done` with the outputs, or with the first error.
    /// Never blocks; `done` runs from the DPC (or inline if the device is
    /// failed). If the device object is gone by then, `done` is dropped.
    pub(crate) fn run_commands(self: &Arc<Self>, commands: Vec<Command>, done: Sequel<P>) {
        let mut commands: VecDeque<Command> = commands.into();
        let outputs = Vec::with_capacity(commands.len());
        match commands.pop_front() {
            None => done(self, Ok(outputs)),
            Some(first) => {
                Self::run_next(Arc::downgrade(self), self, first, commands, outputs, done)
            }
        }
    }

    fn run_next(
        weak: Weak<Self>,
        hca: &Arc<Self>,
        command: Command,
        mut rest: VecDeque<Command>,
        mut outputs: Vec<CommandOutput>,
        done: Sequel<P>,
    ) {
        hca.submit(
            command,
            Box::new(move |result| {
                let Some(hca) = weak.upgrade() else { return };
                match result {
                    Err(error) => done(&hca, Err(error)),
                    Ok(output) => {
                        outputs.push(output);
                        match rest.pop_front() {
                            None => done(&hca, Ok(outputs)),
                            Some(next) => Self::run_next(weak, &hca, next, rest, outputs, done),
                        }
                    }
                }
            }),
        );
    }

    /// Delivers `f` to the open CA's client, counting it in flight so that
    /// close can wait for it; no core lock is held during the call.
    pub(crate) fn deliver(&self, f: impl FnOnce(&dyn CaClient)) {
        self.verbs
            .callbacks_in_flight
            .fetch_add(1, Ordering::AcqRel);
        let client = self
            .verbs
            .objects
            .read()
            .as_ref()
            .and_then(|o| o.ca.as_ref())
            .and_then(|ca| ca.client.clone());
        if let Some(client) = client {
            f(&*client);
        }
        self.verbs
            .callbacks_in_flight
            .fetch_sub(1, Ordering::AcqRel);
    }

    /// Spins until no client callback is running (guide 6.1.4). Callbacks
    /// run at DISPATCH_LEVEL and never block, so the spin ends; it must not
    /// be entered from inside a callback.
    pub(crate) fn wait_for_callbacks(&self) {
        while self.verbs.callbacks_in_flight.load(Ordering::Acquire) != 0 {
            core::hint::spin_loop();
        }
    }

    /// The CQ's current owner's handle for a device CQ number, if the
    /// number is live.
    pub(crate) fn cq_owner(&self, cqn: u32) -> Option<CqHandle> {
        let objects = self.verbs.objects.read();
        let (handle, _) = objects.as_ref()?.cqs.get_by_number(cqn)?;
        Some(handle.into())
    }
}

/// Objects of a CA opened by `owner` are visible to requests of `mode`: a
/// kernel request sees everything; a user request only a user CA's.
fn visible(owner: RequestorMode, mode: RequestorMode) -> bool {
    mode == RequestorMode::Kernel || owner == RequestorMode::User
}

/// The [`EventSink`] the DPC hands events to: routes them to the owning
/// client (see the module doc), then passes each to the outer sink.
pub(crate) struct VerbsRouter<'a, P: Platform> {
    /// The device.
    pub(crate) hca: &'a Hca<P>,
}

impl<P: Platform> EventSink for VerbsRouter<'_, P> {
    fn completion(&self, cqn: u32) {
        self.hca.note_cq_event(cqn);
        // A user CQ's event completes its process's waits ([`user`]); a
        // kernel CQ's goes to the client.
        if let Some(cq) = self.hca.cq_owner(cqn)
            && !self.hca.user_cq_event(cq.raw())
        {
            self.hca.deliver(|client| client.completion(cq));
        }
        self.hca.sink.completion(cqn);
    }

    fn qp_event(&self, qpn: Qpn, event: QpEvent) {
        use ib_types::event::AsyncEventCode as Code;
        let code = match event {
            QpEvent::CommunicationEstablished => Code::QpComm,
            QpEvent::SendQueueDrained => Code::SqDrained,
            QpEvent::PathMigrated => Code::QpApm,
            QpEvent::Fatal => Code::QpFatal,
            QpEvent::InvalidRequest => Code::WqRequestError,
            QpEvent::AccessError => Code::WqAccessError,
            QpEvent::LastWqeReached => Code::QpLastWqeReached,
        };
        if let Some(qp) = self.hca.qp_device_event(qpn.get(), event)
            && let Ok(record) = AsyncEventRecord::new(code, qp, None, 0)
            && !self.hca.user_async_event(&record)
        {
            self.hca.deliver(|client| client.async_event(&record));
        }
        self.hca.sink.qp_event(qpn, event);
    }

    fn srq_event(&self, srqn: u32, event: SrqEvent) {
        let code = match event {
            SrqEvent::LimitReached => ib_types::event::AsyncEventCode::SrqLimitReached,
            SrqEvent::Catastrophic => ib_types::event::AsyncEventCode::SrqCatastrophic,
        };
        if let Some(srq) = self.hca.srq_owner(srqn)
            && let Ok(record) = AsyncEventRecord::new(code, srq, None, 0)
            && !self.hca.user_async_event(&record)
        {
            self.hca.deliver(|client| client.async_event(&record));
        }
        self.hca.sink.srq_event(srqn, event);
    }

    fn cq_error(&self, cqn: u32) {
        if let Some(cq) = self.hca.cq_owner(cqn)
            && let Ok(record) =
                AsyncEventRecord::new(ib_types::event::AsyncEventCode::CqError, cq.raw(), None, 0)
            && !self.hca.user_async_event(&record)
        {
            self.hca.deliver(|client| client.async_event(&record));
        }
        self.hca.sink.cq_error(cqn);
    }

    fn port_change(&self, port: PortNum, active: bool) {
        let code = if active {
            ib_types::event::AsyncEventCode::PortActive
        } else {
            ib_types::event::AsyncEventCode::PortDown
        };
        // An unaffiliated event of the port, like the traps below: for the
        // kernel client and every user context alike.
        if let Ok(record) = AsyncEventRecord::new(code, 0, Some(port), 0) {
            self.hca.user_port_event(&record);
            self.hca.deliver(|client| client.async_event(&record));
        }
        self.hca.sink.port_change(port, active);
    }

    fn port_violation(&self, port: PortNum, violation: PortViolation) {
        // Guide 6.7.4, Table 6-3: the trap is an unaffiliated event of the
        // port, for the kernel client and every user context alike.
        let code = match violation {
            PortViolation::Pkey => ib_types::event::AsyncEventCode::PkeyTrap,
            PortViolation::Qkey => ib_types::event::AsyncEventCode::QkeyTrap,
        };
        if let Ok(record) = AsyncEventRecord::new(code, 0, Some(port), 0) {
            self.hca.user_port_event(&record);
            self.hca.deliver(|client| client.async_event(&record));
        }
        self.hca.sink.port_violation(port, violation);
    }

    fn device_failed(&self, failure: DeviceFailure) {
        self.hca.sink.device_failed(failure);
    }
}
