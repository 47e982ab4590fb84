//! The caller-context phase of a user request (KMDF's
//! `EvtIoInCallerContext`; docs/miniport.md "verbs::user").
//!
//! A user address means something only in its own process, and only the
//! issuing thread runs there: Windows calls `EvtIoInCallerContext` in that
//! thread, before the request is queued; the power-managed queue then
//! presents the request later, possibly in another context (held while the
//! device sleeps and delivered on resume). So a user request is served in
//! two phases:
//!
//! 1. [`Hca::prepare_user_request`], in the caller's context (the shell's
//!    `EvtIoInCallerContext`): everything that reaches into the process.
//!    It probes and locks the user buffers the verb will use (`RegMr`'s
//!    range, `ReregMr`'s new range, the rings and doorbell records of
//!    `CreateCq`/`CreateQp`/`CreateSrq`/`ResizeCq`, as the private data
//!    describes them), maps a doorbell page into the process for `OpenCa`,
//!    unmaps the context's page for `CloseCa`, and notes the process and
//!    the caller's IRQL. It answers nothing and changes no verb object: a
//!    failure (pages the process lacks, a mapping refused) is kept and
//!    answered by the second phase, at the point where the verb would have
//!    met it, so statuses do not depend on the split.
//! 2. [`Hca::execute_user_request`], wherever the queue delivers the
//!    request: the verb itself ([`Hca::submit_user_request`]'s checks and
//!    steps), using only what phase 1 produced. The locked pages are
//!    handed out by [`CallerLocks`], a [`MemoryLocker`] that never touches
//!    the process; DMA mapping, MTT entries and device commands follow as
//!    for any request.
//!
//! The [`PreparedUserRequest`] lives in the request's context between the
//! two. Whatever phase 2 did not take is given back when it drops: locked
//! pages are unlocked (allowed in any context), and a doorbell page mapped
//! for an `OpenCa` that was never answered with it (failed, or the request
//! was cancelled in the queue) is parked with the device until the
//! process's file cleanup ([`Hca::close_user_contexts_of`], in its
//! context) unmaps it and frees its UAR page: a mapping can be removed only
//! in its process.

use alloc::sync::{Arc, Weak};
use alloc::vec::Vec;

use driver_platform::{
    CallerProcess, DmaAdapter, Irql, MemoryLocker, Platform, Request, RequestorMode, SpinLock,
};
use hca_prm::doorbell::uar_offset;
use hca_prm::uverbs::{CreateCqPriv, CreateQpPriv, CreateSrqPriv, ResizeCqPriv, UserRange};
use ib_types::ioctl::{self as v, RESPONSE_HEADER_SIZE, Verb, VerbId, decode_request};
use ib_types::status::{IbStatus, NtStatus};

use crate::hca::Hca;

type Pages<P> = <<P as Platform>::Dma as DmaAdapter>::Pages;
pub(crate) type Mapping<P> = <<P as Platform>::Caller as CallerProcess>::Mapping;

/// One range phase 1 tried to lock: the pages, or why the locker refused.
struct Locked<P: Platform> {
    va: u64,
    len: u64,
    writable: bool,
    pages: Result<Pages<P>, NtStatus>,
}

/// The user pages a request's caller-context phase locked, handed out to
/// its queued phase as a [`MemoryLocker`] that never reaches into the
/// process: `lock` gives back the pages locked for exactly that range (a
/// writable lock serves a read-only request), or the status the caller's
/// locker answered for it. A range phase 1 did not lock is refused.
pub struct CallerLocks<P: Platform> {
    locked: SpinLock<P, Vec<Locked<P>>>,
}

impl<P: Platform> CallerLocks<P> {
    fn new() -> Self {
        Self {
            locked: SpinLock::<P, _>::new(Vec::new()),
        }
    }

    /// Locks `range` with the caller's locker, now, in its context.
    fn lock_in_caller(&self, caller: &P::Caller, range: UserRange, writable: bool) {
        let pages = caller
            .locker()
            .lock(RequestorMode::User, range.va, range.len, writable);
        self.locked.lock().push(Locked {
            va: range.va,
            len: range.len,
            writable,
            pages,
        });
    }

    /// Ranges locked (or refused), for tests of the split.
    fn len(&self) -> usize {
        self.locked.lock().len()
    }
}

impl<P: Platform> core::fmt::Debug for CallerLocks<P> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("CallerLocks")
            .field("ranges", &self.len())
            .finish()
    }
}

impl<P: Platform> MemoryLocker for CallerLocks<P> {
    type Pages = Pages<P>;

    fn lock(
        &self,
        mode: RequestorMode,
        va: u64,
        len: u64,
        writable: bool,
    ) -> Result<Self::Pages, NtStatus> {
        if mode != RequestorMode::User {
            return Err(NtStatus::ACCESS_DENIED);
        }
        let mut locked = self.locked.lock();
        let found = locked
            .iter()
            .position(|l| l.va == va && l.len == len && (l.writable || !writable));
        match found {
            Some(index) => locked.swap_remove(index).pages,
            // Not locked in the caller's context: never touch the process
            // from here.
            None => Err(NtStatus::ACCESS_DENIED),
        }
    }

    fn read_kernel(&self, _va: u64, _out: &mut [u8]) -> Result<(), NtStatus> {
        Err(NtStatus::ACCESS_DENIED)
    }
}

/// A UAR page mapped into the caller for its `OpenCa`.
pub(crate) struct PreparedDoorbell<P: Platform> {
    pub(crate) uar: u32,
    pub(crate) mapping: Mapping<P>,
}

/// What the caller-context phase of a user request produced (see the
/// module doc): keep it in the request's context and hand it to
/// [`Hca::execute_user_request`] with the request.
pub struct PreparedUserRequest<P: Platform> {
    pub(crate) process: u64,
    /// The caller's IRQL in phase 1 (what the locks were taken at).
    pub(crate) irql: Irql,
    pub(crate) locks: CallerLocks<P>,
    /// `OpenCa`: the page mapped, or why the mapping failed.
    pub(crate) doorbell: Option<Result<PreparedDoorbell<P>, IbStatus>>,
    hca: Weak<Hca<P>>,
}

impl<P: Platform> core::fmt::Debug for PreparedUserRequest<P> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("PreparedUserRequest")
            .field("process", &self.process)
            .field("irql", &self.irql)
            .field("locks", &self.locks)
            .field(
                "doorbell",
                &self.doorbell.as_ref().map(|d| d.as_ref().map(|d| d.uar)),
            )
            .finish_non_exhaustive()
    }
}

impl<P: Platform> PreparedUserRequest<P> {
    /// The process the request came from (`PsGetProcessId`).
    pub fn process_id(&self) -> u64 {
        self.process
    }

    /// How many user ranges phase 1 locked or tried to.
    pub fn locked_ranges(&self) -> usize {
        self.locks.len()
    }

    /// Takes the doorbell page phase 1 mapped.
    pub(crate) fn take_doorbell(&mut self) -> Option<Result<PreparedDoorbell<P>, IbStatus>> {
        self.doorbell.take()
    }
}

impl<P: Platform> Drop for PreparedUserRequest<P> {
    fn drop(&mut self) {
        // Unused locks unlock as they drop. A doorbell page nobody took
        // stays mapped in the process until its cleanup unmaps it there.
        if let Some(Ok(doorbell)) = self.doorbell.take() {
            match self.hca.upgrade() {
                Some(hca) => hca.park_doorbell(self.process, doorbell),
                None => drop(doorbell),
            }
        }
    }
}

impl<P: Platform> Hca<P>
where
    P::Request: 'static,
{
    /// Phase 1 of a user request (see the module doc): call it in the
    /// caller's context (the shell's `EvtIoInCallerContext`, PASSIVE_LEVEL
    /// for a user-mode caller) before the request is queued. Answers
    /// nothing; keep the result in the request's context for
    /// [`execute_user_request`](Self::execute_user_request).
    pub fn prepare_user_request(
        self: &Arc<Self>,
        request: &mut P::Request,
        caller: &P::Caller,
    ) -> PreparedUserRequest<P> {
        let mut prepared = PreparedUserRequest {
            process: caller.process_id(),
            irql: caller.current_irql(),
            locks: CallerLocks::new(),
            doorbell: None,
            hca: Arc::downgrade(self),
        };
        if request.requestor_mode() == RequestorMode::Kernel {
            return prepared;
        }
        // Pageable user memory is locked at APC_LEVEL or below; above, the
        // verb refuses (`mr`'s ceiling) and nothing is locked here.
        let lockable = prepared.irql <= Irql::APC;
        let Ok(verb) = VerbId::from_ioctl(v::IoctlCode::from_raw(request.ioctl_code())) else {
            return prepared;
        };
        let locks = &prepared.locks;
        let lock = |range: UserRange, writable: bool| {
            if lockable {
                locks.lock_in_caller(caller, range, writable);
            }
        };
        let input = request.input();
        match verb {
            VerbId::RegMr => {
                if let Ok(r) = decode_request::<v::RegMr>(input) {
                    let range = UserRange {
                        va: r.input.vaddr,
                        len: r.input.length,
                    };
                    lock(range, crate::mr::needs_write(r.input.access));
                }
            }
            VerbId::ReregMr => {
                if let Ok(r) = decode_request::<v::ReregMr>(input)
                    && let Some((va, len)) = r.input.translation
                {
                    let access = r.input.access.or_else(|| self.region_access(r.handle));
                    if let Some(access) = access {
                        lock(UserRange { va, len }, crate::mr::needs_write(access));
                    }
                }
            }
            VerbId::CreateCq => {
                if let Ok(r) = decode_request::<v::CreateCq>(input)
                    && let Ok(layout) = CreateCqPriv::parse(r.private)
                {
                    lock(layout.ring, true);
                    lock(layout.dbr, true);
                }
            }
            VerbId::ResizeCq => {
                if let Ok(r) = decode_request::<v::ResizeCq>(input)
                    && let Ok(layout) = ResizeCqPriv::parse(r.private)
                {
                    lock(layout.ring, true);
                }
            }
            VerbId::CreateQp => {
                if let Ok(r) = decode_request::<v::CreateQp>(input)
                    && let Ok(layout) = CreateQpPriv::parse(r.private)
                {
                    lock(layout.sq, true);
                    if let Some(rq) = layout.rq {
                        lock(rq.ring, true);
                        lock(rq.dbr, true);
                    }
                }
            }
            VerbId::CreateSrq => {
                if let Ok(r) = decode_request::<v::CreateSrq>(input)
                    && let Ok(layout) = CreateSrqPriv::parse(r.private)
                {
                    lock(layout.ring, true);
                    lock(layout.dbr, true);
                }
            }
            VerbId::OpenCa => {
                let room = open_ca_private_room(request);
                prepared.doorbell = self.prepare_doorbell(caller, prepared.irql, room);
            }
            VerbId::CloseCa => {
                if let Ok(r) = decode_request::<v::CloseCa>(request.input()) {
                    self.unmap_closing_doorbell(caller, prepared.irql, r.handle);
                }
            }
            _ => {}
        }
        prepared
    }

    /// Phase 2 of a user request: the verb, wherever the queue delivers
    /// it, with what [`prepare_user_request`](Self::prepare_user_request)
    /// produced for it; completes the request exactly once. Touches no
    /// process memory.
    pub fn execute_user_request(
        self: &Arc<Self>,
        request: P::Request,
        prepared: PreparedUserRequest<P>,
    ) {
        self.run_user_request(request, prepared);
    }

    /// Both phases at once, for a caller already in its context (tests and
    /// in-process callers): [`prepare_user_request`] then
    /// [`execute_user_request`].
    ///
    /// [`prepare_user_request`]: Self::prepare_user_request
    /// [`execute_user_request`]: Self::execute_user_request
    pub fn submit_user_request(self: &Arc<Self>, mut request: P::Request, caller: P::Caller) {
        let prepared = self.prepare_user_request(&mut request, &caller);
        self.execute_user_request(request, prepared);
    }

    /// `OpenCa`'s part in the caller: a UAR page of the device mapped
    /// uncached into the process. `None` when the request will be refused
    /// before it needs one (no room for the answer, not PASSIVE_LEVEL).
    fn prepare_doorbell(
        &self,
        caller: &P::Caller,
        irql: Irql,
        private_room: usize,
    ) -> Option<Result<PreparedDoorbell<P>, IbStatus>> {
        if private_room < hca_prm::uverbs::OpenCaPriv::SIZE || irql != Irql::PASSIVE {
            return None;
        }
        let uar = self.with_objects_mut(|o| match o.user.uars.as_mut() {
            Some(uars) => uars.alloc().map_err(|_| IbStatus::InsufficientResources),
            None => Err(IbStatus::InsufficientResources),
        });
        let uar = match uar.and_then(|r| r) {
            Ok(uar) => uar,
            Err(status) => return Some(Err(status)),
        };
        Some(match caller.map_device_page(&self.bar0, uar_offset(uar)) {
            Ok(mapping) => Ok(PreparedDoorbell { uar, mapping }),
            Err(_) => {
                let _ = self.with_objects_mut(|o| o.user.uars.as_mut().map(|u| u.free(uar)));
                Err(IbStatus::InsufficientResources)
            }
        })
    }
}

/// The private output room an `OpenCa` request leaves (as `accept`
/// computes it), 0 when it is malformed.
fn open_ca_private_room<R: Request>(request: &mut R) -> usize {
    let fixed = RESPONSE_HEADER_SIZE + <v::OpenCa as Verb>::ID.out_size();
    let Ok(max) = decode_request::<v::OpenCa>(request.input()).map(|r| r.private_out_max) else {
        return 0;
    };
    let output_len = request.output().len();
    output_len.saturating_sub(fixed).min(max as usize)
}
