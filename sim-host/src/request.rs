//! Requests: the IRP / WDFREQUEST model.
//!
//! A [`HostRequest`] carries an I/O control code, the requestor mode, a
//! METHOD_BUFFERED input buffer and an output buffer. Exactly one party owns
//! it at a time — the issuer hands it to a device stack, a driver forwards it
//! down (giving it up) or keeps it pending, and whoever owns it last
//! completes it by consuming it. A driver that builds a request owns it
//! until it sends it; the host makes each layer it delivers the request to
//! its owner. Completion by code of another driver (a request handed
//! across an interface to the provider's routine, which runs as the
//! provider's code through [`crate::driver::InterfaceRef::call`]) is
//! [`ViolationKind::RequestCompletedByNonOwner`]: the provider sends the
//! request to its own device instead
//! ([`crate::pnp::DeviceServices::send_to_own_device`]). Completion runs the completion routines the
//! forwarding drivers attached, innermost first, then reports to the issuer
//! through its [`RequestHandle`].
//!
//! Completing twice does not compile:
//!
//! ```compile_fail
//! use driver_platform::{Request, RequestorMode};
//! use ib_types::status::NtStatus;
//! use sim_host::{request::HostRequest, verifier::Verifier};
//! let (req, _handle) = HostRequest::new(&Verifier::new(), 1, RequestorMode::Kernel, vec![], 0);
//! req.complete(NtStatus::from_raw(0), 0);
//! req.complete(NtStatus::from_raw(0), 0); // use of moved value
//! ```
//!
//! What Rust makes structural, the host still checks: a request dropped
//! without completion is a `RequestNotCompleted` violation (and the issuer
//! sees `STATUS_CANCELLED`-like abandonment as an error), cancellation is a
//! flag the owner must honour, and completion is refused above
//! DISPATCH_LEVEL.
//!
//! A power-managed queue keeps a [`QueueRecord`] of the requests it
//! presented to its driver and the driver has not completed (KMDF's
//! driver-owned requests). When the device leaves D0 the host calls the
//! driver's `EvtIoStop` for each with a [`StoppedRequest`], through which
//! the driver acknowledges it (`WdfRequestStopAcknowledge`), keeping it or
//! giving it back to be presented again after D0 entry; or the driver
//! completes it. One that is neither blocks the power transition on
//! Windows and is a `RequestBlocksPowerDown` violation here.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use driver_platform::{Event, Request, RequestorMode};
use ib_types::status::NtStatus;

use crate::event::HostEvent;
use crate::memory::Process;
use crate::verifier::{Verifier, ViolationKind};

/// How a request ended, as its issuer sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The final status.
    pub status: NtStatus,
    /// `IoStatus.Information`: bytes returned, or a handle.
    pub information: u64,
    /// The output buffer as the last owner left it.
    pub output: Vec<u8>,
}

#[derive(Debug, Default)]
struct Shared {
    completion: Option<Completion>,
    /// The request was dropped uncompleted.
    abandoned: bool,
    canceled: bool,
}

#[derive(Debug, Default)]
struct Slot {
    state: Mutex<Shared>,
    done: Condvar,
}

/// The issuer's side of a request: waits for or polls its completion, and
/// can ask for cancellation.
#[derive(Debug, Clone)]
pub struct RequestHandle {
    slot: Arc<Slot>,
}

impl RequestHandle {
    /// The completion, once it happened.
    pub fn completion(&self) -> Option<Completion> {
        self.lock().completion.clone()
    }

    /// True once completed (or abandoned).
    pub fn is_done(&self) -> bool {
        let s = self.lock();
        s.completion.is_some() || s.abandoned
    }

    /// True if the request was dropped without completion.
    pub fn was_abandoned(&self) -> bool {
        self.lock().abandoned
    }

    /// Asks the current owner to cancel (`IoCancelIrp`).
    pub fn cancel(&self) {
        self.lock().canceled = true;
    }

    /// Blocks until completion or abandonment (threaded hosts only; a
    /// deterministic host runs its scheduler instead).
    pub fn wait(&self) -> Option<Completion> {
        crate::irql::check_max("KeWaitForSingleObject", driver_platform::Irql::PASSIVE);
        let mut s = self.lock();
        while s.completion.is_none() && !s.abandoned {
            s = self.slot.done.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        s.completion.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.slot.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A request's identity while it lives (what its `WDFREQUEST` handle
/// names): unique within the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(u64);

impl RequestId {
    fn next() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Self(NEXT.fetch_add(1, Ordering::Relaxed))
    }

    /// The raw number (for reports).
    pub fn raw(self) -> u64 {
        self.0
    }
}

/// Why the framework calls `EvtIoStop` (`WDF_REQUEST_STOP_ACTION_FLAGS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopAction {
    /// `WdfRequestStopActionSuspend`: the device leaves D0 and will come
    /// back (sleep, rebalance).
    Suspend,
    /// `WdfRequestStopActionPurge`: the device is being removed.
    Purge,
}

/// Where a driver-owned request of a power-managed queue stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Presented {
    /// Being processed.
    Working,
    /// `EvtIoStop` was called; neither acknowledged nor completed yet.
    Stopping,
    /// Acknowledged without requeue: the driver keeps it and gets
    /// `EvtIoResume` for it on D0 entry.
    Acknowledged,
}

#[derive(Debug, Default)]
struct QueueState {
    /// Presented and not completed: the I/O control code and the stand.
    owned: BTreeMap<RequestId, (u32, Presented)>,
    /// Given back with requeue, to be presented again after D0 entry.
    requeued: Vec<HostRequest>,
}

/// The requests one power-managed queue presented to its driver that the
/// driver has not completed, and those it gave back on stop.
#[derive(Debug, Default)]
pub struct QueueRecord {
    state: Mutex<QueueState>,
}

impl QueueRecord {
    fn lock(&self) -> MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The queue stops: every request being processed is now stopping;
    /// returns them (id and I/O control code), for `EvtIoStop`.
    pub(crate) fn begin_stop(&self) -> Vec<(RequestId, u32)> {
        let mut s = self.lock();
        s.owned
            .iter_mut()
            .filter(|(_, (_, at))| *at == Presented::Working)
            .map(|(&id, (ioctl, at))| {
                *at = Presented::Stopping;
                (id, *ioctl)
            })
            .collect()
    }

    /// The requests still stopping (neither acknowledged nor completed).
    pub(crate) fn still_stopping(&self) -> Vec<(RequestId, u32)> {
        self.lock()
            .owned
            .iter()
            .filter(|(_, (_, at))| *at == Presented::Stopping)
            .map(|(&id, (ioctl, _))| (id, *ioctl))
            .collect()
    }

    /// The queue restarts (D0 entry): every stopped request is being
    /// processed again. Returns the acknowledged ones (for
    /// `EvtIoResume`) and the requeued ones (to present again).
    pub(crate) fn restart(&self) -> (Vec<(RequestId, u32)>, Vec<HostRequest>) {
        let mut s = self.lock();
        let mut resumed = Vec::new();
        for (&id, (ioctl, at)) in s.owned.iter_mut() {
            if *at == Presented::Acknowledged {
                resumed.push((id, *ioctl));
            }
            *at = Presented::Working;
        }
        (resumed, std::mem::take(&mut s.requeued))
    }

    /// Takes the requests given back with requeue (the queue is purged).
    pub(crate) fn take_requeued(&self) -> Vec<HostRequest> {
        std::mem::take(&mut self.lock().requeued)
    }
}

/// A request the framework names in `EvtIoStop` or `EvtIoResume`: its
/// handle and I/O control code (what `WdfRequestGetParameters` reads), and
/// the acknowledgement.
#[derive(Debug, Clone)]
pub struct StoppedRequest {
    id: RequestId,
    ioctl: u32,
    action: StopAction,
    queue: Arc<QueueRecord>,
    verifier: Verifier,
}

impl StoppedRequest {
    pub(crate) fn new(
        id: RequestId,
        ioctl: u32,
        action: StopAction,
        queue: Arc<QueueRecord>,
        verifier: Verifier,
    ) -> Self {
        Self {
            id,
            ioctl,
            action,
            queue,
            verifier,
        }
    }

    /// The request.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Its I/O control code.
    pub fn ioctl(&self) -> u32 {
        self.ioctl
    }

    /// Why the queue stops.
    pub fn action(&self) -> StopAction {
        self.action
    }

    /// `WdfRequestStopAcknowledge(Request, FALSE)`: the driver keeps the
    /// request, has stopped whatever of it needs the hardware, and gets
    /// `EvtIoResume` for it on D0 entry. May be called after `EvtIoStop`
    /// returned. Acknowledging a request the driver no longer owns (it
    /// completed it) is a `Protocol` violation (a bug check on Windows).
    pub fn acknowledge(&self) {
        let mut s = self.queue.lock();
        match s.owned.get_mut(&self.id) {
            Some((_, at)) if *at != Presented::Working => *at = Presented::Acknowledged,
            _ => {
                drop(s);
                self.report_stale("WdfRequestStopAcknowledge");
            }
        }
    }

    /// `WdfRequestStopAcknowledge(Request, TRUE)`: gives `request` back to
    /// its queue, which presents it again after D0 entry (or completes it
    /// if the device is removed). `request` must be the one this names; a
    /// different one, or one the queue did not present, is a `Protocol`
    /// violation and is completed with `STATUS_CANCELLED` so nothing is
    /// lost.
    pub fn requeue(&self, mut request: HostRequest) {
        let mut s = self.queue.lock();
        let ours = request.id == self.id
            && request
                .queue
                .as_ref()
                .is_some_and(|q| Arc::ptr_eq(q, &self.queue))
            && s.owned.remove(&self.id).is_some();
        if ours {
            request.queue = None;
            s.requeued.push(request);
            return;
        }
        drop(s);
        self.report_stale("WdfRequestStopAcknowledge(requeue)");
        request.complete(crate::driver::CANCELLED, 0);
    }

    fn report_stale(&self, what: &str) {
        self.verifier.report(
            crate::context::current_driver().as_deref(),
            ViolationKind::Protocol {
                detail: format!(
                    "{what} on request {} ({:#010x}) that is not stopping in its queue",
                    self.id.0, self.ioctl
                ),
            },
        );
    }
}

/// A completion routine a forwarding driver attaches: it sees the lower
/// driver's status and information and may change them (`IoSetCompletionRoutine`).
pub type CompletionRoutine = Box<dyn FnOnce(&mut NtStatus, &mut u64, &mut [u8]) + Send>;

/// An I/O request owned by whoever holds it.
pub struct HostRequest {
    ioctl: u32,
    mode: RequestorMode,
    input: Vec<u8>,
    output: Vec<u8>,
    slot: Arc<Slot>,
    /// Innermost (most recently attached) last.
    routines: Vec<CompletionRoutine>,
    verifier: Verifier,
    /// The driver that owns the request now (for attribution).
    owner: Option<Arc<str>>,
    completed: bool,
    /// Set once the issuer's completion is recorded.
    event: Option<HostEvent>,
    /// The process of the thread that issued a user-mode request (what
    /// WDF's `EvtIoInCallerContext` runs in), if the issuer gave it.
    process: Option<Process>,
    id: RequestId,
    /// The power-managed queue that presented it to its current owner.
    queue: Option<Arc<QueueRecord>>,
    /// The file object the request was sent on (a handle's), referenced
    /// until the request is completed or dropped.
    file: Option<crate::file::FileReference>,
    /// The driver's request context (`WdfObjectGetTypedContext` of a
    /// `WDFREQUEST`): what its `EvtIoInCallerContext` prepared, dropped
    /// with the request (the context's cleanup callback).
    context: Option<Box<dyn std::any::Any + Send>>,
}

impl std::fmt::Debug for HostRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRequest")
            .field("ioctl", &format_args!("{:#010x}", self.ioctl))
            .field("mode", &self.mode)
            .field("owner", &self.owner)
            .finish_non_exhaustive()
    }
}

impl HostRequest {
    /// A new request and the issuer's handle to it.
    pub fn new(
        verifier: &Verifier,
        ioctl: u32,
        mode: RequestorMode,
        input: Vec<u8>,
        output_len: usize,
    ) -> (Self, RequestHandle) {
        let slot = Arc::new(Slot::default());
        let handle = RequestHandle { slot: slot.clone() };
        // A driver that builds a request owns it until it sends it.
        let owner = crate::context::current_driver();
        let request = Self {
            ioctl,
            mode,
            input,
            output: vec![0; output_len],
            slot,
            routines: Vec::new(),
            verifier: verifier.clone(),
            owner,
            completed: false,
            event: None,
            process: None,
            id: RequestId::next(),
            queue: None,
            file: None,
            context: None,
        };
        (request, handle)
    }

    /// Records the process whose thread issued the request (a user-mode
    /// request's caller: a driver reaches into that process only while it
    /// serves the request in the caller's context).
    pub fn set_process(&mut self, process: Process) {
        self.process = Some(process);
    }

    /// Records the file object the request is sent on (`IRP_MJ_DEVICE_CONTROL`
    /// on a handle): it stays referenced until the request ends.
    pub fn set_file(&mut self, file: crate::file::FileReference) {
        self.file = Some(file);
    }

    /// The file object the request was sent on, if any
    /// (`WdfRequestGetFileObject`).
    pub fn file(&self) -> Option<&crate::file::FileObject> {
        self.file.as_ref().map(crate::file::FileReference::file)
    }

    /// Stores the owner's request context (replacing one stored before):
    /// what `EvtIoInCallerContext` prepared for the queued phase. It is
    /// dropped when the request is completed or dropped, as WDF deletes a
    /// request's context with it.
    pub fn set_context<T: std::any::Any + Send>(&mut self, context: T) {
        self.context = Some(Box::new(context));
    }

    /// Takes the request context back if it is a `T`.
    pub fn take_context<T: std::any::Any + Send>(&mut self) -> Option<T> {
        match self.context.take()?.downcast::<T>() {
            Ok(context) => Some(*context),
            Err(other) => {
                self.context = Some(other);
                None
            }
        }
    }

    /// The issuing process, if the issuer recorded it.
    pub fn process(&self) -> Option<&Process> {
        self.process.as_ref()
    }

    /// Records the driver that now owns the request.
    pub fn set_owner(&mut self, driver: Option<Arc<str>>) {
        self.owner = driver;
    }

    /// The driver that owns the request.
    pub fn owner(&self) -> Option<&str> {
        self.owner.as_deref()
    }

    /// The request's identity (its `WDFREQUEST` handle).
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Records that `queue` (a power-managed queue) presents the request
    /// to its driver, or, with `None`, that no such queue does any more
    /// (held, or passed on to a layer without one).
    pub(crate) fn present_from(&mut self, queue: Option<Arc<QueueRecord>>) {
        self.leave_queue();
        if let Some(q) = &queue {
            q.lock()
                .owned
                .insert(self.id, (self.ioctl, Presented::Working));
        }
        self.queue = queue;
    }

    fn leave_queue(&mut self) {
        if let Some(q) = self.queue.take() {
            q.lock().owned.remove(&self.id);
        }
    }

    /// The event to set when the request is done (the `Event` argument of
    /// `IoBuildDeviceIoControlRequest`): set after every completion routine
    /// ran and the issuer's completion is recorded, so a waiter that wakes
    /// finds it (also set if the request is abandoned, so no waiter hangs).
    pub fn set_completion_event(&mut self, event: HostEvent) {
        self.event = Some(event);
    }

    /// Attaches a completion routine before forwarding the request down.
    pub fn set_completion_routine(&mut self, routine: CompletionRoutine) {
        self.routines.push(routine);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.slot.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Request for HostRequest {
    fn ioctl_code(&self) -> u32 {
        self.ioctl
    }

    fn requestor_mode(&self) -> RequestorMode {
        self.mode
    }

    fn input(&self) -> &[u8] {
        &self.input
    }

    fn output(&mut self) -> &mut [u8] {
        &mut self.output
    }

    fn complete(mut self, status: NtStatus, information: u64) {
        crate::irql::check_max("WdfRequestComplete", driver_platform::Irql::DISPATCH);
        // The host itself (a queue purged at removal) may complete anyone's
        // request; a driver only its own.
        if let (Some(by), Some(owner)) = (crate::context::current_driver(), self.owner.as_deref())
            && *by != *owner
        {
            self.verifier.report(
                Some(&by),
                ViolationKind::RequestCompletedByNonOwner {
                    ioctl: self.ioctl,
                    by: by.to_string(),
                },
            );
        }
        let mut status = status;
        let mut information = information;
        // Completion routines run innermost first (the driver that forwarded
        // last sees the result first), as IoCompleteRequest does.
        while let Some(routine) = self.routines.pop() {
            routine(&mut status, &mut information, &mut self.output);
        }
        self.completed = true;
        self.leave_queue();
        let output = std::mem::take(&mut self.output);
        let mut s = self.lock();
        s.completion = Some(Completion {
            status,
            information,
            output,
        });
        drop(s);
        self.slot.done.notify_all();
        if let Some(event) = self.event.take() {
            event.set();
        }
    }

    fn is_canceled(&self) -> bool {
        self.lock().canceled
    }
}

impl Drop for HostRequest {
    fn drop(&mut self) {
        if self.completed {
            return;
        }
        self.leave_queue();
        self.verifier.report(
            self.owner.as_deref(),
            ViolationKind::RequestNotCompleted { ioctl: self.ioctl },
        );
        self.lock().abandoned = true;
        self.slot.done.notify_all();
        if let Some(event) = self.event.take() {
            event.set();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_completion_event_is_set_after_the_issuer_can_see_the_completion() {
        let v = Verifier::new();
        let sched = crate::sched::Scheduler::deterministic(1, v.clone());
        let event = HostEvent::new(sched.handle());
        let (mut req, handle) = HostRequest::new(&v, 0x3B_E000, RequestorMode::Kernel, vec![], 4);
        let (seen, probe) = (event.clone(), handle.clone());
        // A completion routine runs before the event is set, and before the
        // issuer sees the completion.
        req.set_completion_routine(Box::new(move |_, _, _| {
            assert!(!seen.is_set());
            assert!(probe.completion().is_none());
        }));
        req.set_completion_event(event.clone());
        req.complete(NtStatus::from_raw(0), 2);
        assert!(event.is_set());
        assert_eq!(handle.completion().unwrap().information, 2);

        // Abandoned: the event is set too, so a waiter does not hang.
        let event = HostEvent::new(sched.handle());
        let (mut req, handle) = HostRequest::new(&v, 0x3B_E004, RequestorMode::Kernel, vec![], 0);
        req.set_completion_event(event.clone());
        drop(req);
        assert!(event.is_set() && handle.was_abandoned());
    }

    #[test]
    fn a_request_carries_the_process_that_issued_it() {
        let v = Verifier::new();
        let (mut req, handle) = HostRequest::new(&v, 0x3B_E000, RequestorMode::User, vec![], 0);
        assert!(req.process().is_none());
        req.set_process(Process::new(41));
        assert_eq!(req.process().map(Process::pid), Some(41));
        req.complete(NtStatus::from_raw(0), 0);
        assert!(handle.is_done());
    }

    #[test]
    fn completion_reaches_the_issuer_with_routines_applied() {
        let v = Verifier::new();
        let (mut req, handle) = HostRequest::new(&v, 0x3B_E000, RequestorMode::User, vec![1, 2], 4);
        assert_eq!(req.input(), &[1, 2]);
        req.output()[0] = 9;
        // An upper driver forwards with a routine that rewrites the status.
        req.set_completion_routine(Box::new(|status, info, out| {
            assert_eq!(*status, NtStatus::from_raw(0xC000_0001));
            *status = NtStatus::from_raw(0);
            *info += 1;
            out[1] = 7;
        }));
        assert!(!handle.is_done());
        req.complete(NtStatus::from_raw(0xC000_0001), 3);
        let c = handle.completion().unwrap();
        assert_eq!(c.status, NtStatus::from_raw(0));
        assert_eq!(c.information, 4);
        assert_eq!(c.output, vec![9, 7, 0, 0]);
        v.assert_clean();
    }

    #[test]
    fn dropping_without_completion_is_a_violation() {
        let v = Verifier::new();
        let (mut req, handle) = HostRequest::new(&v, 0x42, RequestorMode::Kernel, vec![], 0);
        req.set_owner(Some(Arc::from("broken")));
        drop(req);
        assert!(handle.was_abandoned() && handle.is_done());
        let violations = v.take();
        assert_eq!(violations.len(), 1);
        assert_eq!(violations[0].driver.as_deref(), Some("broken"));
        assert_eq!(
            violations[0].kind,
            ViolationKind::RequestNotCompleted { ioctl: 0x42 }
        );
    }

    #[test]
    fn cancellation_is_visible_to_the_owner() {
        let v = Verifier::new();
        let (req, handle) = HostRequest::new(&v, 1, RequestorMode::User, vec![], 0);
        assert!(!req.is_canceled());
        handle.cancel();
        assert!(req.is_canceled());
        req.complete(NtStatus::from_raw(0xC000_0120), 0);
        assert_eq!(handle.wait().unwrap().status.raw(), 0xC000_0120);
    }

    #[test]
    fn wait_across_threads() {
        let v = Verifier::new();
        let (req, handle) = HostRequest::new(&v, 1, RequestorMode::User, vec![], 0);
        let t = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(5));
            req.complete(NtStatus::from_raw(0), 0);
        });
        assert_eq!(handle.wait().unwrap().status.raw(), 0);
        t.join().unwrap();
    }
}
