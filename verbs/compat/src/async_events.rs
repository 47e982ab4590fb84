//! Asynchronous events: the context's `async_fd`,
//! `ibv_get_async_event` and `ibv_ack_async_event`, with rdma-core's
//! semantics (docs/libibverbs.md, "Asynchronous events").
//!
//! **The descriptor.** Each context's `async_fd` is an `eventfd` in
//! semaphore mode, which programs `poll` or make `O_NONBLOCK`. A thread
//! per context, started at `ibv_open_device`, waits in the access
//! library's [`ibal_user::Context::async_event`] (`GetAsyncEvent`: the
//! kernel keeps events that arrive with no wait pending, so none is lost);
//! each event it receives is resolved to the program's own object, queued,
//! and counted in the descriptor. `ibv_get_async_event` reads one count
//! (blocking, or `EAGAIN` on a non-blocking descriptor) and takes the
//! oldest queued event.
//!
//! **The element.** An affiliated event names the QP, CQ or SRQ by the
//! kernel's handle; the thread finds the program's `ibv_qp`, `ibv_cq` or
//! `ibv_srq` among the objects the context tracks (each is tracked from its
//! create to its destroy): the front of the object's slot (`crate::slots`).
//! The slot tables find an object by that pointer, not by a handle, so the
//! context keeps this one map from handle to pointer. An event of an object no longer tracked (its
//! destroy has begun) is dropped; so are the queued events of an object
//! being destroyed (their count stays in the descriptor, and a later read
//! skips it, as `cq`'s completion channels do).
//!
//! **The destroy rule** (rdma-core's `events_completed` counting): every
//! event `ibv_get_async_event` returned for an object is counted until
//! `ibv_ack_async_event` acknowledges it, and `ibv_destroy_qp`,
//! `ibv_destroy_cq` and `ibv_destroy_srq` wait, after the kernel destroyed
//! the object, until that count is zero, so an element a program holds
//! never dangles. A QP's or SRQ's destroy has taken its slot before the
//! kernel's destroy (no call runs on it meanwhile), so an acknowledgement
//! finds the count by the element's address among the contexts' events,
//! not through the slot; the slot is not handed out again before the
//! destroy returns, so the address names one object meanwhile.
//!
//! **The event types** are rdma-core's `enum ibv_event_type`, mapped from
//! the stack's [`AsyncEventCode`] by [`event_type_of`]; the stack's codes
//! with no rdma-core counterpart (the send queue error, which the failed
//! completion reports, and the guide's Table 6-3 traps and thresholds,
//! which are the subnet manager's) are dropped.
//!
//! **The end.** The thread ends when its wait fails. The context's last
//! reference (`ibv_close_device` once nothing made on it remains, or the
//! last such object destroyed after the close) closes the CA
//! ([`ibal_user::Context::close`]), which ends the pending wait, and joins
//! the thread; at process exit the simulated process's exit cancels it.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_int;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError, Weak};
use std::thread::JoinHandle;

use ib_types::event::{AsyncEventCode, AsyncEventRecord, EventSubject};
use ibverbs_abi::{
    IBV_EVENT_CLIENT_REREGISTER, IBV_EVENT_COMM_EST, IBV_EVENT_CQ_ERR, IBV_EVENT_DEVICE_FATAL,
    IBV_EVENT_GID_CHANGE, IBV_EVENT_LID_CHANGE, IBV_EVENT_PATH_MIG, IBV_EVENT_PATH_MIG_ERR,
    IBV_EVENT_PKEY_CHANGE, IBV_EVENT_PORT_ACTIVE, IBV_EVENT_PORT_ERR, IBV_EVENT_QP_ACCESS_ERR,
    IBV_EVENT_QP_FATAL, IBV_EVENT_QP_LAST_WQE_REACHED, IBV_EVENT_QP_REQ_ERR, IBV_EVENT_SM_CHANGE,
    IBV_EVENT_SQ_DRAINED, IBV_EVENT_SRQ_ERR, IBV_EVENT_SRQ_LIMIT_REACHED, IbvAsyncEvent,
    IbvAsyncEventElement, IbvContext, IbvEventType, IbvQp,
};

use crate::device::open_context;
use crate::event_fd::EventFd;
use crate::util::{guard, lock, set_errno};

/// rdma-core's event type for one of the stack's codes; `None` for the
/// codes rdma-core has no event for (they are dropped).
pub(crate) fn event_type_of(code: AsyncEventCode) -> Option<IbvEventType> {
    use AsyncEventCode as C;
    Some(match code {
        // A receive queue error leaves the QP in the Error state, as a
        // local work queue catastrophic error does.
        C::QpFatal | C::RqError => IBV_EVENT_QP_FATAL,
        C::WqRequestError => IBV_EVENT_QP_REQ_ERR,
        C::WqAccessError => IBV_EVENT_QP_ACCESS_ERR,
        C::QpComm => IBV_EVENT_COMM_EST,
        C::SqDrained => IBV_EVENT_SQ_DRAINED,
        C::QpApm => IBV_EVENT_PATH_MIG,
        C::QpApmError => IBV_EVENT_PATH_MIG_ERR,
        C::QpLastWqeReached => IBV_EVENT_QP_LAST_WQE_REACHED,
        C::CqError => IBV_EVENT_CQ_ERR,
        C::SrqLimitReached => IBV_EVENT_SRQ_LIMIT_REACHED,
        C::SrqCatastrophic => IBV_EVENT_SRQ_ERR,
        C::LocalCatastrophic => IBV_EVENT_DEVICE_FATAL,
        C::PortActive => IBV_EVENT_PORT_ACTIVE,
        C::PortDown => IBV_EVENT_PORT_ERR,
        C::LidChange => IBV_EVENT_LID_CHANGE,
        C::PkeyChange => IBV_EVENT_PKEY_CHANGE,
        C::GidChange => IBV_EVENT_GID_CHANGE,
        C::SmChange => IBV_EVENT_SM_CHANGE,
        C::ClientReregister => IBV_EVENT_CLIENT_REREGISTER,
        // rdma-core reports a send queue error by the failed completion
        // only; traps and thresholds are the subnet manager's.
        C::SqError
        | C::PkeyTrap
        | C::QkeyTrap
        | C::MkeyTrap
        | C::BufferOverrun
        | C::LinkIntegrity => return None,
    })
}

/// The kind of object an affiliated event names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum ObjectKind {
    Qp,
    Cq,
    Srq,
}

/// What a queued event is about.
#[derive(Debug, Clone, Copy)]
enum Element {
    /// The program's `ibv_qp`, `ibv_cq` or `ibv_srq` (its address).
    Object(usize),
    Port(u8),
    Device,
}

#[derive(Debug, Clone, Copy)]
struct Queued {
    event_type: IbvEventType,
    element: Element,
}

#[derive(Default)]
struct EventState {
    /// The context's live objects: (kind, kernel handle) -> the program's
    /// object (its address).
    tracked: HashMap<(ObjectKind, u64), usize>,
    /// Events not taken yet, oldest first.
    queue: VecDeque<Queued>,
    /// Per object (its address): events taken and not acknowledged.
    unacked: HashMap<usize, u64>,
}

/// One context's asynchronous events: its descriptor, queue and counts.
pub(crate) struct AsyncEvents {
    fd: EventFd,
    state: Mutex<EventState>,
    /// Signalled at each acknowledgement (destroys wait on it).
    acked: Condvar,
    /// Set when the context goes: the thread delivers nothing more.
    stopping: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// Every context's events (for `ibv_ack_async_event`, which names only
/// the object).
static ALL: Mutex<Vec<Weak<AsyncEvents>>> = Mutex::new(Vec::new());

impl AsyncEvents {
    /// A fresh descriptor and an empty queue; no thread yet
    /// ([`start`](Self::start)).
    pub(crate) fn new() -> Result<Arc<Self>, c_int> {
        let events = Arc::new(Self {
            fd: EventFd::new()?,
            state: Mutex::new(EventState::default()),
            acked: Condvar::new(),
            stopping: AtomicBool::new(false),
            thread: Mutex::new(None),
        });
        let mut all = lock(&ALL);
        all.retain(|weak| weak.strong_count() > 0);
        all.push(Arc::downgrade(&events));
        Ok(events)
    }

    /// The descriptor programs see as `async_fd`.
    pub(crate) fn raw_fd(&self) -> RawFd {
        self.fd.raw_fd()
    }

    /// Starts the thread that waits for `ca`'s events; `ENOMEM` when it
    /// cannot be made.
    pub(crate) fn start(self: &Arc<Self>, ca: Arc<ibal_user::Context>) -> Result<(), c_int> {
        let events = Arc::clone(self);
        let thread = std::thread::Builder::new()
            .name("ibv-async-events".into())
            .spawn(move || {
                // Ends when the wait fails: the CA closed (`stop`) or the
                // process's machine gone.
                while let Ok(record) = ca.async_event() {
                    if events.stopping.load(Ordering::Acquire) {
                        break;
                    }
                    events.deliver(&record);
                }
            })
            .map_err(|_| libc::ENOMEM)?;
        *lock(&self.thread) = Some(thread);
        Ok(())
    }

    /// Ends the thread: closes `ca`, which ends its pending wait, and
    /// joins it. The context's last reference calls it.
    pub(crate) fn stop(&self, ca: &ibal_user::Context) {
        self.stopping.store(true, Ordering::Release);
        let Some(thread) = lock(&self.thread).take() else {
            return;
        };
        // An error means the CA is gone already (the process's machine
        // ended): its wait ended then too.
        let _ = ca.close();
        let _ = thread.join();
    }

    /// Queues `record` for the program, resolved to its object; dropped
    /// when rdma-core has no such event or the object is not tracked.
    fn deliver(&self, record: &AsyncEventRecord) {
        let Some(event_type) = event_type_of(record.code) else {
            return;
        };
        let kind = match record.code.subject() {
            EventSubject::Qp => Some(ObjectKind::Qp),
            EventSubject::Cq => Some(ObjectKind::Cq),
            EventSubject::Srq => Some(ObjectKind::Srq),
            EventSubject::Port | EventSubject::Ca => None,
        };
        {
            let mut state = lock(&self.state);
            let element = match (kind, record.port) {
                (Some(kind), _) => match state.tracked.get(&(kind, record.handle)) {
                    Some(&object) => Element::Object(object),
                    None => return,
                },
                (None, Some(port)) => Element::Port(port.get()),
                (None, None) => Element::Device,
            };
            state.queue.push_back(Queued {
                event_type,
                element,
            });
        }
        self.fd.post_one("the async event descriptor");
    }

    /// Tracks the program's object at `object` (its `ibv_qp`, `ibv_cq` or
    /// `ibv_srq`), whose kernel handle is `handle`, from its create on.
    pub(crate) fn track(&self, kind: ObjectKind, handle: u64, object: usize) {
        lock(&self.state).tracked.insert((kind, handle), object);
    }

    /// The destroy rule, once the kernel destroyed the object at `object`:
    /// no event is delivered for it any more, its queued events are
    /// dropped, and this waits until every event taken for it was
    /// acknowledged.
    pub(crate) fn forget(&self, object: usize) {
        let mut state = lock(&self.state);
        state.tracked.retain(|_, tracked| *tracked != object);
        state
            .queue
            .retain(|queued| !matches!(queued.element, Element::Object(o) if o == object));
        while state.unacked.get(&object).is_some_and(|&n| n > 0) {
            state = self
                .acked
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
        state.unacked.remove(&object);
    }

    /// The next event: reads one count from the descriptor (blocking
    /// unless the program made it non-blocking), skipping those of dropped
    /// events. `Err` with the read's errno.
    fn next(&self) -> Result<IbvAsyncEvent, c_int> {
        self.fd.take(|| {
            let mut state = lock(&self.state);
            // None: the count of an event dropped by a destroy (skipped).
            let queued = state.queue.pop_front()?;
            let element = match queued.element {
                Element::Object(object) => {
                    *state.unacked.entry(object).or_default() += 1;
                    IbvAsyncEventElement {
                        qp: object as *mut IbvQp,
                    }
                }
                Element::Port(port) => IbvAsyncEventElement {
                    port_num: c_int::from(port),
                },
                Element::Device => IbvAsyncEventElement { port_num: 0 },
            };
            Some(IbvAsyncEvent {
                element,
                event_type: queued.event_type,
            })
        })
    }

    /// Acknowledges one event taken for the object at `object`; `false`
    /// when no event of it is outstanding here.
    fn ack(&self, object: usize) -> bool {
        let mut state = lock(&self.state);
        match state.unacked.get_mut(&object) {
            Some(count) if *count > 0 => {
                *count -= 1;
                drop(state);
                self.acked.notify_all();
                true
            }
            _ => false,
        }
    }
}

/// `ibv_get_async_event(context, event)`: the context's next asynchronous
/// event, its `element` the program's own `ibv_qp`, `ibv_cq` or `ibv_srq`,
/// or the port number. Blocks until one comes unless the program made
/// `async_fd` `O_NONBLOCK`. 0, or -1 with `errno`: `EINVAL` for a context
/// that is not open or a NULL `event`, `EAGAIN` on a non-blocking
/// descriptor with no event.
///
/// # Safety
///
/// `event` is NULL or valid for a write of an `ibv_async_event`.
pub unsafe extern "C" fn ibv_get_async_event(
    context: *mut IbvContext,
    event: *mut IbvAsyncEvent,
) -> c_int {
    guard(-1, || {
        let events = match open_context(context) {
            Ok(context) if !event.is_null() => Arc::clone(&context.events),
            _ => {
                set_errno(libc::EINVAL);
                return -1;
            }
        };
        // The context itself is not held while this blocks: closing it
        // meanwhile is not held up.
        match events.next() {
            Ok(next) => {
                // SAFETY: non-NULL (checked above), valid for a write (the
                // contract).
                unsafe { event.write(next) };
                0
            }
            Err(errno) => {
                set_errno(errno);
                -1
            }
        }
    })
}

/// `ibv_ack_async_event(event)`: acknowledges an event
/// [`ibv_get_async_event`] returned (what the destroy of its QP, CQ or SRQ
/// waits for). Port and device events need none; an event whose element
/// is not an object with an event outstanding, or NULL, is ignored (the
/// verb returns nothing).
///
/// # Safety
///
/// `event` is NULL or valid for a read of an `ibv_async_event`.
pub unsafe extern "C" fn ibv_ack_async_event(event: *mut IbvAsyncEvent) {
    guard((), || {
        // SAFETY: NULL or valid for a read (the contract).
        let Some(event) = (unsafe { event.as_ref() }) else {
            return;
        };
        if !matches!(
            event.event_type,
            IBV_EVENT_CQ_ERR
                | IBV_EVENT_QP_FATAL
                | IBV_EVENT_QP_REQ_ERR
                | IBV_EVENT_QP_ACCESS_ERR
                | IBV_EVENT_COMM_EST
                | IBV_EVENT_SQ_DRAINED
                | IBV_EVENT_PATH_MIG
                | IBV_EVENT_PATH_MIG_ERR
                | IBV_EVENT_QP_LAST_WQE_REACHED
                | IBV_EVENT_SRQ_ERR
                | IBV_EVENT_SRQ_LIMIT_REACHED
        ) {
            return;
        }
        // SAFETY: every pointer member of the union is one address (for
        // these types the library wrote one of them); it is only compared,
        // never dereferenced.
        let object = unsafe { event.element.qp } as usize;
        let all: Vec<Arc<AsyncEvents>> = lock(&ALL).iter().filter_map(Weak::upgrade).collect();
        for events in all {
            if events.ack(object) {
                break;
            }
        }
    });
}
