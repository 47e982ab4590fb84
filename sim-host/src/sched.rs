//! Deferred work and time: DPCs, work items, timers and the host's own
//! tasks, run at the IRQL Windows runs them at.
//!
//! Contract (the Windows behaviour it models):
//!
//! - A DPC runs at DISPATCH_LEVEL, a work item at PASSIVE_LEVEL, an expired
//!   timer's routine at DISPATCH_LEVEL (its DPC); a host task (stepping the
//!   simulated device, delivering a PnP event) at PASSIVE_LEVEL. Each runs
//!   inside the [`context`] of the driver it belongs to and an
//!   [`IrqlGuard`], so a routine that returns at the wrong IRQL is recorded.
//! - [`DeviceDeferred`] is one device's DPC, work item and timer, the
//!   [`Deferred`] of the simulated platform: queueing what is already queued
//!   and not yet started coalesces (`KeInsertQueueDpc` returning FALSE);
//!   an item is dequeued before its routine runs, so the routine may queue
//!   it again. Queueing a work item or setting the timer above
//!   DISPATCH_LEVEL is recorded as [`ViolationKind::IrqlTooHigh`] (and still
//!   done); a DPC may be queued at any IRQL.
//! - Re-arming a pending timer replaces its expiry; cancelling removes it.
//!   Neither touches an expiry that already fired and is waiting to run
//!   (`KeCancelTimer` does not dequeue the timer's DPC).
//!
//! Two modes behind one [`Scheduler`]:
//!
//! - **Deterministic** ([`Scheduler::deterministic`]): nothing runs until
//!   the test calls [`Scheduler::run_one`], which picks the next item among
//!   all ready ones by a draw from a seeded generator, the way several CPUs
//!   interleave DPCs, work items and device activity. A seed reproduces the
//!   interleaving exactly (STYLE item 14); different seeds explore different
//!   ones. Time is virtual: it moves only when nothing is ready (to the next
//!   timer) or when the test calls [`Scheduler::advance`] or
//!   [`Scheduler::run_for`]. Everything runs on the calling thread, which
//!   models every CPU: a routine that panics unwinds into the caller. When
//!   several threads run the machine (a process's threads each waiting for
//!   its request), they take turns: a run never returns while another
//!   thread's run is inside an item.
//! - **Threaded** ([`Scheduler::threaded`]): worker threads run items as
//!   they arrive (first in, first out), a timer thread releases timers in
//!   real time, and [`Scheduler::quiesce`] waits until nothing is queued or
//!   running. A routine that panics is caught, its worker survives, and the
//!   panic is returned by the next [`Scheduler::quiesce`].
//!
//! The [`Scheduler`] owns its threads; [`SchedulerHandle`]s (what
//! [`DeviceDeferred`] holds) queue work and read the time. Dropping the
//! `Scheduler` stops its threads and discards everything still queued or
//! armed (breaking reference cycles between queued routines and the
//! devices that queued them); later queueing through a handle is ignored.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::ops::Deref;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};

use driver_platform::{Deferred, Irql};
use sim_hca::rng::Rng;

use crate::context::{self, Context};
use crate::irql::{self, IrqlGuard};
use crate::stack::{self, RoutineKind};
use crate::verifier::{Verifier, ViolationKind};

/// A queued routine: run once, on whichever thread runs the item.
pub type Routine = Box<dyn FnOnce() + Send + 'static>;

/// A device's DPC, work-item or timer routine: run every time it is
/// queued.
pub type DeferredRoutine = Arc<dyn Fn() + Send + Sync + 'static>;

/// What an item is, which fixes the IRQL it runs at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ItemKind {
    /// A DPC: DISPATCH_LEVEL.
    Dpc,
    /// A work item: PASSIVE_LEVEL.
    WorkItem,
    /// An expired timer's routine: DISPATCH_LEVEL.
    Timer,
    /// A host task (stepping the device, a PnP event): PASSIVE_LEVEL.
    Task,
}

impl ItemKind {
    /// The IRQL items of this kind run at.
    pub fn irql(self) -> Irql {
        match self {
            Self::Dpc | Self::Timer => Irql::DISPATCH,
            Self::WorkItem | Self::Task => Irql::PASSIVE,
        }
    }
}

/// What [`Scheduler::run_one`] ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RanItem {
    /// Its kind.
    pub kind: ItemKind,
    /// The task's name, or the driver's name for DPCs, work items and
    /// timers.
    pub label: Arc<str>,
    /// The driver it ran as, if any.
    pub driver: Option<Arc<str>>,
    /// Virtual time when it ran.
    pub at_ns: u64,
}

/// Names one timer of a scheduler ([`SchedulerHandle::new_timer`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TimerId(u64);

/// The scheduler's mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Single-threaded, seeded, virtual time.
    Deterministic,
    /// Worker threads, real time.
    Threaded,
}

/// Why a scheduler call did not do what was asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SchedulerError {
    /// Work was still pending after the step budget: a livelock, or a
    /// periodic timer that never stops re-arming.
    #[error("still busy after {steps} steps")]
    StepLimit {
        /// Items run before giving up.
        steps: usize,
    },
    /// The operation exists only in the other mode.
    #[error("`{operation}` is not available in {mode:?} mode")]
    WrongMode {
        /// What was called.
        operation: &'static str,
        /// The scheduler's mode.
        mode: Mode,
    },
    /// A routine panicked on a worker thread (threaded mode).
    #[error("item `{label}` panicked: {message}")]
    ItemPanicked {
        /// The item's label.
        label: String,
        /// The panic message.
        message: String,
    },
}

/// A unit of deferred work.
struct Item {
    kind: ItemKind,
    label: Arc<str>,
    driver: Option<Arc<str>>,
    routine: Routine,
}

impl fmt::Debug for Item {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Item")
            .field("kind", &self.kind)
            .field("label", &self.label)
            .field("driver", &self.driver)
            .finish_non_exhaustive()
    }
}

/// Orders pending timers: expiry first, then arming order.
type TimerKey = (u64, u64);

/// Everything the scheduler's lock protects.
#[derive(Debug)]
struct State {
    /// Items ready to run. Deterministic mode picks by seed, threaded FIFO.
    ready: VecDeque<Item>,
    /// Armed timers by expiry.
    timers: BTreeMap<TimerKey, (TimerId, Item)>,
    /// Where each armed timer sits in `timers`.
    armed: HashMap<TimerId, TimerKey>,
    /// Arming order, to break expiry ties deterministically.
    next_seq: u64,
    /// The next [`TimerId`].
    next_timer: u64,
    /// Virtual time (deterministic mode).
    virtual_now: u64,
    /// The seeded choice among ready items (deterministic mode).
    rng: Rng,
    /// Items taken off `ready` and not finished.
    running: usize,
    /// Set when the [`Scheduler`] is dropped.
    shutdown: bool,
    /// Panics caught on worker threads, for [`Scheduler::quiesce`].
    panics: Vec<(Arc<str>, String)>,
}

impl State {
    fn next_due(&self) -> Option<u64> {
        self.timers.keys().next().map(|&(due, _)| due)
    }

    /// Moves every timer due at or before `now` to the ready queue, in
    /// expiry order.
    fn release_due(&mut self, now: u64) {
        while let Some(entry) = self.timers.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let (id, item) = entry.remove();
            self.armed.remove(&id);
            self.ready.push_back(item);
        }
    }

    /// Removes `timer`'s pending expiry, returning its item to drop outside
    /// the lock.
    fn disarm(&mut self, timer: TimerId) -> Option<Item> {
        let key = self.armed.remove(&timer)?;
        self.timers.remove(&key).map(|(_, item)| item)
    }

    fn is_idle(&self) -> bool {
        self.ready.is_empty() && self.running == 0 && self.timers.is_empty()
    }
}

/// How the scheduler tells time.
#[derive(Debug)]
enum Clock {
    /// `State::virtual_now`.
    Virtual,
    /// Nanoseconds since `origin`.
    Real { origin: Instant },
}

/// State shared by the scheduler, its handles and its threads.
#[derive(Debug)]
struct Shared {
    mode: Mode,
    verifier: Verifier,
    clock: Clock,
    state: Mutex<State>,
    /// Signalled when items become ready (workers wait on it).
    work_ready: Condvar,
    /// Signalled when timers are armed or cancelled (the timer thread).
    timers_changed: Condvar,
    /// Signalled when nothing is ready or running ([`Scheduler::quiesce`]).
    idle: Condvar,
    /// The thread running the deterministic machine, and how deep: one
    /// thread at a time runs it ([`Shared::take_turn`]).
    driver: Mutex<Option<(ThreadId, usize)>>,
    /// Signalled when no thread runs the deterministic machine.
    driver_free: Condvar,
}

impl Shared {
    fn new(mode: Mode, verifier: Verifier, clock: Clock, rng: Rng) -> Self {
        Self {
            mode,
            verifier,
            clock,
            state: Mutex::new(State {
                ready: VecDeque::new(),
                timers: BTreeMap::new(),
                armed: HashMap::new(),
                next_seq: 0,
                next_timer: 0,
                virtual_now: 0,
                rng,
                running: 0,
                shutdown: false,
                panics: Vec::new(),
            }),
            work_ready: Condvar::new(),
            timers_changed: Condvar::new(),
            idle: Condvar::new(),
            driver: Mutex::new(None),
            driver_free: Condvar::new(),
        }
    }

    /// The calling thread's turn at running the deterministic machine,
    /// until the guard drops; taken again by the thread that holds it (a
    /// routine may run the machine). Two threads running it at once would
    /// each see the other's running item as nothing ready and return
    /// early, with work (a request's completion) still to come.
    fn take_turn(&self) -> Turn<'_> {
        let me = std::thread::current().id();
        let mut driver = self.driver.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            match &mut *driver {
                None => {
                    *driver = Some((me, 1));
                    break;
                }
                Some((owner, depth)) if *owner == me => {
                    *depth += 1;
                    break;
                }
                Some(_) => {
                    driver = self
                        .driver_free
                        .wait(driver)
                        .unwrap_or_else(PoisonError::into_inner);
                }
            }
        }
        Turn(self)
    }

    /// Locks the state. Routines never run under this lock, so a poisoned
    /// lock only means a panic in the scheduler's own bookkeeping; the
    /// state is still consistent and is used as is.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn real_now(origin: Instant) -> u64 {
        u64::try_from(origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}

/// A thread's turn at the deterministic machine ([`Shared::take_turn`]),
/// given back when dropped (also when a routine unwinds through it).
struct Turn<'a>(&'a Shared);

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let mut driver = self.0.driver.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, depth)) = &mut *driver {
            *depth -= 1;
            if *depth == 0 {
                *driver = None;
                self.0.driver_free.notify_one();
            }
        }
    }
}

/// Counts an item as running until dropped (also when its routine
/// unwinds), then wakes [`Scheduler::quiesce`] if that was the last one.
struct Running<'a>(&'a Shared);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.running -= 1;
        if state.running == 0 && state.ready.is_empty() {
            self.0.idle.notify_all();
        }
    }
}

/// Runs `item` in its driver's context at its kind's IRQL.
fn run_item(verifier: &Verifier, item: Item) {
    let Item {
        kind,
        driver,
        routine,
        label,
    } = item;
    // The routine's code is gone with its driver: report, do not run it.
    if let Some(d) = &driver
        && !verifier.check_callback(d, &label)
    {
        return;
    }
    let _context = context::enter(Context {
        verifier: verifier.clone(),
        driver,
    });
    // Declared after the context so it drops first: a routine returning at
    // the wrong IRQL is charged to its driver.
    let _irql = IrqlGuard::switched(kind.irql());
    // DPCs, timers and work items run in an arbitrary thread: no
    // process's context (`caller`).
    let _arbitrary_thread = crate::caller::enter_arbitrary_thread();
    // A driver's routine runs on a kernel-sized stack; the host's tasks
    // are not drivers.
    let stack = match kind {
        ItemKind::Dpc => Some((RoutineKind::Dpc, "DPC")),
        ItemKind::Timer => Some((RoutineKind::Dpc, "timer DPC")),
        ItemKind::WorkItem => Some((RoutineKind::WorkItem, "work item")),
        ItemKind::Task => None,
    };
    match stack {
        Some((kind, name)) => stack::measured(kind, name, routine),
        None => routine(),
    }
}

/// A cheap, cloneable handle to a scheduler: queue work, arm timers, read
/// the time. Callable from any thread, at any IRQL, from inside routines.
#[derive(Clone)]
pub struct SchedulerHandle {
    shared: Arc<Shared>,
}

impl fmt::Debug for SchedulerHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SchedulerHandle")
            .field("mode", &self.shared.mode)
            .field("now_ns", &self.now_ns())
            .finish_non_exhaustive()
    }
}

impl SchedulerHandle {
    /// The scheduler's mode.
    pub fn mode(&self) -> Mode {
        self.shared.mode
    }

    /// The verifier the scheduler's items report to.
    pub fn verifier(&self) -> &Verifier {
        &self.shared.verifier
    }

    /// Current time in nanoseconds: virtual in deterministic mode, since
    /// the scheduler's creation in threaded mode.
    pub fn now_ns(&self) -> u64 {
        match self.shared.clock {
            Clock::Virtual => self.shared.lock().virtual_now,
            Clock::Real { origin } => Shared::real_now(origin),
        }
    }

    /// True if nothing is ready, running or armed.
    pub fn is_idle(&self) -> bool {
        self.shared.lock().is_idle()
    }

    fn push(&self, item: Item) {
        // The queue is the host's (`KeInsertQueueDpc` allocates nothing).
        let _host = crate::alloc_hook::HostCode::enter();
        let mut state = self.shared.lock();
        if state.shutdown {
            drop(state);
            drop(item);
            return;
        }
        state.ready.push_back(item);
        drop(state);
        self.shared.work_ready.notify_one();
    }

    /// Queues `routine` to run as `driver`'s DPC, at DISPATCH_LEVEL. No
    /// coalescing here: that is [`DeviceDeferred`]'s job.
    pub fn queue_dpc(&self, driver: impl Into<Arc<str>>, routine: impl FnOnce() + Send + 'static) {
        let driver = driver.into();
        self.push(Item {
            kind: ItemKind::Dpc,
            label: driver.clone(),
            driver: Some(driver),
            routine: Box::new(routine),
        });
    }

    /// Queues `routine` to run as `driver`'s work item, at PASSIVE_LEVEL.
    pub fn queue_work_item(
        &self,
        driver: impl Into<Arc<str>>,
        routine: impl FnOnce() + Send + 'static,
    ) {
        let driver = driver.into();
        self.push(Item {
            kind: ItemKind::WorkItem,
            label: driver.clone(),
            driver: Some(driver),
            routine: Box::new(routine),
        });
    }

    /// Queues a host task (no driver: e.g. "step the simulated device"),
    /// run at PASSIVE_LEVEL. A task that calls into a driver enters that
    /// driver's context itself.
    pub fn schedule_task(&self, name: impl Into<Arc<str>>, task: impl FnOnce() + Send + 'static) {
        self.push(Item {
            kind: ItemKind::Task,
            label: name.into(),
            driver: None,
            routine: Box::new(task),
        });
    }

    /// A new timer, unarmed.
    pub fn new_timer(&self) -> TimerId {
        let mut state = self.shared.lock();
        state.next_timer += 1;
        TimerId(state.next_timer)
    }

    /// Arms `timer` to run `routine` as `driver`'s timer routine (at
    /// DISPATCH_LEVEL) at absolute time `due_ns`, replacing a pending
    /// expiry. A time already past fires as soon as possible. Returns true
    /// if a pending expiry was replaced (`KeSetTimer`'s result).
    pub fn set_timer(
        &self,
        timer: TimerId,
        driver: impl Into<Arc<str>>,
        due_ns: u64,
        routine: impl FnOnce() + Send + 'static,
    ) -> bool {
        let driver = driver.into();
        let item = Item {
            kind: ItemKind::Timer,
            label: driver.clone(),
            driver: Some(driver),
            routine: Box::new(routine),
        };
        self.arm(timer, due_ns, item)
    }

    fn arm(&self, timer: TimerId, due_ns: u64, item: Item) -> bool {
        let _host = crate::alloc_hook::HostCode::enter();
        let mut state = self.shared.lock();
        if state.shutdown {
            drop(state);
            drop(item);
            return false;
        }
        let replaced = state.disarm(timer);
        let key = (due_ns, state.next_seq);
        state.next_seq += 1;
        state.timers.insert(key, (timer, item));
        state.armed.insert(timer, key);
        drop(state);
        self.shared.timers_changed.notify_one();
        replaced.is_some()
    }

    /// Arms `timer` to queue a host task (no driver, PASSIVE_LEVEL) at
    /// absolute time `due_ns`: how the simulated device's own deadlines
    /// (retransmission, RNR and ACK timers) join the host's one clock.
    /// Replaces a pending expiry; returns true if there was one.
    pub fn schedule_task_at(
        &self,
        timer: TimerId,
        name: impl Into<Arc<str>>,
        due_ns: u64,
        task: impl FnOnce() + Send + 'static,
    ) -> bool {
        self.arm(
            timer,
            due_ns,
            Item {
                kind: ItemKind::Task,
                label: name.into(),
                driver: None,
                routine: Box::new(task),
            },
        )
    }

    /// Cancels `timer`'s pending expiry; returns true if there was one
    /// (`KeCancelTimer`'s result).
    pub fn cancel_timer(&self, timer: TimerId) -> bool {
        let cancelled = self.shared.lock().disarm(timer);
        self.shared.timers_changed.notify_one();
        cancelled.is_some()
    }
}

/// The scheduler: owns the worker threads (threaded mode) and drives the
/// run (deterministic mode). Dereferences to its [`SchedulerHandle`].
#[derive(Debug)]
pub struct Scheduler {
    handle: SchedulerHandle,
    threads: Vec<JoinHandle<()>>,
}

impl Deref for Scheduler {
    type Target = SchedulerHandle;

    fn deref(&self) -> &SchedulerHandle {
        &self.handle
    }
}

impl Scheduler {
    /// A single-threaded scheduler in virtual time, whose interleaving is
    /// determined by `seed`; violations go to `verifier`.
    pub fn deterministic(seed: u64, verifier: Verifier) -> Self {
        let shared = Shared::new(
            Mode::Deterministic,
            verifier,
            Clock::Virtual,
            Rng::from_seed(seed),
        );
        Self {
            handle: SchedulerHandle {
                shared: Arc::new(shared),
            },
            threads: Vec::new(),
        }
    }

    /// A scheduler with `workers` worker threads (at least one) and a
    /// timer thread, in real time; violations go to `verifier`. Fails only
    /// if the OS refuses a thread.
    pub fn threaded(workers: usize, verifier: Verifier) -> std::io::Result<Self> {
        let clock = Clock::Real {
            origin: Instant::now(),
        };
        let shared = Arc::new(Shared::new(
            Mode::Threaded,
            verifier,
            clock,
            Rng::from_seed(0),
        ));
        // Built first so that a failed spawn drops it, stopping the threads
        // already started.
        let mut scheduler = Self {
            handle: SchedulerHandle {
                shared: Arc::clone(&shared),
            },
            threads: Vec::new(),
        };
        for n in 0..workers.max(1) {
            let shared = Arc::clone(&shared);
            let thread = std::thread::Builder::new()
                .name(format!("sim-host-worker-{n}"))
                .spawn(move || worker_loop(&shared))?;
            scheduler.threads.push(thread);
        }
        let thread = std::thread::Builder::new()
            .name("sim-host-timers".to_owned())
            .spawn(move || timer_loop(&shared))?;
        scheduler.threads.push(thread);
        Ok(scheduler)
    }

    /// A handle for devices and tasks to queue work through.
    pub fn handle(&self) -> SchedulerHandle {
        self.handle.clone()
    }

    fn require(&self, mode: Mode, operation: &'static str) -> Result<(), SchedulerError> {
        if self.mode() == mode {
            Ok(())
        } else {
            Err(SchedulerError::WrongMode {
                operation,
                mode: self.mode(),
            })
        }
    }

    /// Runs one item (deterministic mode): a seeded pick among the ready
    /// items; if none is ready, virtual time first jumps to the next timer.
    /// `Ok(None)` when nothing is ready and no timer is armed.
    pub fn run_one(&self) -> Result<Option<RanItem>, SchedulerError> {
        self.require(Mode::Deterministic, "run_one")?;
        let _turn = self.shared.take_turn();
        Ok(self.step(None))
    }

    /// Runs items until nothing is ready and no timer is armed
    /// (deterministic mode); returns how many ran. More than `max_steps`
    /// items is [`SchedulerError::StepLimit`].
    pub fn run_until_idle(&self, max_steps: usize) -> Result<usize, SchedulerError> {
        self.require(Mode::Deterministic, "run_until_idle")?;
        self.run_steps(None, max_steps)
    }

    /// Runs everything that is ready or falls due within the next `ns` of
    /// virtual time, then sets the clock to that deadline (deterministic
    /// mode); returns how many items ran. More than `max_steps` is
    /// [`SchedulerError::StepLimit`].
    pub fn run_for(&self, ns: u64, max_steps: usize) -> Result<usize, SchedulerError> {
        self.require(Mode::Deterministic, "run_for")?;
        let deadline = self.now_ns().saturating_add(ns);
        let steps = self.run_steps(Some(deadline), max_steps)?;
        let mut state = self.shared.lock();
        state.virtual_now = state.virtual_now.max(deadline);
        Ok(steps)
    }

    /// Moves virtual time forward by `ns` without running anything
    /// (deterministic mode): timers that fall due become ready.
    pub fn advance(&self, ns: u64) -> Result<(), SchedulerError> {
        self.require(Mode::Deterministic, "advance")?;
        let mut state = self.shared.lock();
        state.virtual_now = state.virtual_now.saturating_add(ns);
        let now = state.virtual_now;
        state.release_due(now);
        Ok(())
    }

    /// Waits until nothing is queued or running (threaded mode). Armed
    /// timers are not waited for. Returns the first panic caught on a
    /// worker since the last call, if any.
    pub fn quiesce(&self) -> Result<(), SchedulerError> {
        self.require(Mode::Threaded, "quiesce")?;
        let mut state = self.shared.lock();
        while !(state.ready.is_empty() && state.running == 0) {
            state = self
                .shared
                .idle
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
        let panics = std::mem::take(&mut state.panics);
        match panics.into_iter().next() {
            Some((label, message)) => Err(SchedulerError::ItemPanicked {
                label: label.to_string(),
                message,
            }),
            None => Ok(()),
        }
    }

    fn run_steps(&self, deadline: Option<u64>, max_steps: usize) -> Result<usize, SchedulerError> {
        let _turn = self.shared.take_turn();
        let mut steps = 0;
        while steps < max_steps {
            if self.step(deadline).is_none() {
                return Ok(steps);
            }
            steps += 1;
        }
        if self.has_work(deadline) {
            Err(SchedulerError::StepLimit { steps })
        } else {
            Ok(steps)
        }
    }

    /// True if [`Self::step`] with `deadline` would run something.
    fn has_work(&self, deadline: Option<u64>) -> bool {
        let state = self.shared.lock();
        !state.ready.is_empty()
            || state
                .next_due()
                .is_some_and(|due| deadline.is_none_or(|deadline| due <= deadline))
    }
}

impl SchedulerHandle {
    /// Deterministic mode: picks and runs one item, jumping time to the next
    /// timer (if at or before `deadline`) when nothing is ready.
    fn step(&self, deadline: Option<u64>) -> Option<RanItem> {
        let (item, at_ns) = {
            let mut state = self.shared.lock();
            let now = state.virtual_now;
            state.release_due(now);
            if state.ready.is_empty() {
                let due = state.next_due()?;
                if deadline.is_some_and(|deadline| due > deadline) {
                    return None;
                }
                state.virtual_now = now.max(due);
                let now = state.virtual_now;
                state.release_due(now);
            }
            let ready = u64::try_from(state.ready.len()).unwrap_or(u64::MAX);
            let index = usize::try_from(state.rng.below(ready)).unwrap_or(0);
            let item = state.ready.remove(index)?;
            state.running += 1;
            (item, state.virtual_now)
        };
        let ran = RanItem {
            kind: item.kind,
            label: item.label.clone(),
            driver: item.driver.clone(),
            at_ns,
        };
        let _running = Running(&self.shared);
        run_item(&self.shared.verifier, item);
        Some(ran)
    }

    /// Runs one item on the calling thread for a PASSIVE_LEVEL waiter
    /// (deterministic mode): while this processor waits, the others run,
    /// so whatever will end the wait gets its turn. Returns false when
    /// nothing is ready and no timer is armed (the wait would never end),
    /// and always in threaded mode, where the workers run items on their
    /// own.
    pub(crate) fn run_one_for_waiter(&self) -> bool {
        self.mode() == Mode::Deterministic && self.step(None).is_some()
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        let discarded = {
            let mut state = self.shared.lock();
            state.shutdown = true;
            state.armed.clear();
            (
                std::mem::take(&mut state.ready),
                std::mem::take(&mut state.timers),
            )
        };
        self.shared.work_ready.notify_all();
        self.shared.timers_changed.notify_all();
        self.shared.idle.notify_all();
        let me = std::thread::current().id();
        for thread in self.threads.drain(..) {
            // A routine owning the scheduler could drop it on a worker; that
            // worker exits on its own once the routine returns.
            if thread.thread().id() != me {
                // A worker that panicked outside a routine has nothing left
                // to clean up.
                let _ = thread.join();
            }
        }
        // Outside the lock: dropping routines may drop handles and devices.
        drop(discarded);
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(message) = payload.downcast_ref::<&str>() {
        (*message).to_owned()
    } else if let Some(message) = payload.downcast_ref::<String>() {
        message.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

/// A worker thread: runs ready items first in, first out until shutdown.
fn worker_loop(shared: &Shared) {
    loop {
        let item = {
            let mut state = shared.lock();
            loop {
                if state.shutdown {
                    return;
                }
                if let Some(item) = state.ready.pop_front() {
                    state.running += 1;
                    break item;
                }
                state = shared
                    .work_ready
                    .wait(state)
                    .unwrap_or_else(PoisonError::into_inner);
            }
        };
        let label = item.label.clone();
        let _running = Running(shared);
        let outcome = catch_unwind(AssertUnwindSafe(|| run_item(&shared.verifier, item)));
        if let Err(payload) = outcome {
            let message = panic_message(payload.as_ref());
            shared.lock().panics.push((label, message));
        }
    }
}

/// The timer thread: moves timers to the ready queue when they fall due.
fn timer_loop(shared: &Shared) {
    let Clock::Real { origin } = shared.clock else {
        return;
    };
    let mut state = shared.lock();
    loop {
        if state.shutdown {
            return;
        }
        let now = Shared::real_now(origin);
        state = match state.next_due() {
            Some(due) if due <= now => {
                state.release_due(now);
                shared.work_ready.notify_all();
                state
            }
            Some(due) => {
                shared
                    .timers_changed
                    .wait_timeout(state, Duration::from_nanos(due - now))
                    .unwrap_or_else(PoisonError::into_inner)
                    .0
            }
            None => shared
                .timers_changed
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner),
        };
    }
}

/// One device's DPC, work item and timer: the simulated platform's
/// [`Deferred`]. Cloning shares the device's state.
#[derive(Clone)]
pub struct DeviceDeferred {
    inner: Arc<DeviceInner>,
}

struct DeviceInner {
    scheduler: SchedulerHandle,
    driver: Arc<str>,
    dpc: DeferredRoutine,
    work_item: DeferredRoutine,
    timer_routine: DeferredRoutine,
    /// Queued and not yet started. Set by the queuer (AcqRel swap), cleared
    /// by the item just before the routine runs (Release); the scheduler's
    /// lock orders the routine's own data.
    dpc_queued: AtomicBool,
    /// Same discipline as `dpc_queued`.
    work_item_queued: AtomicBool,
    /// How often the DPC was queued, and how many of those have finished
    /// (run to completion, or discarded unrun): a flush waits until
    /// `finished` reaches what `queued` was when it started.
    dpc_runs: RunCounts,
    /// Same for the work item.
    work_item_runs: RunCounts,
    timer: TimerId,
}

impl DeviceInner {
    /// Counts a run of the routine `which` selects as queued; the returned
    /// token counts it finished when dropped, after the routine returned
    /// (or unwound), or with the scheduler's item if it is discarded unrun.
    fn queue_run(self: &Arc<Self>, which: fn(&Self) -> &RunCounts) -> RunToken {
        which(self).queued.fetch_add(1, Ordering::AcqRel);
        RunToken {
            inner: Arc::clone(self),
            which,
        }
    }
}

/// Queued and finished runs of one deferred routine.
#[derive(Default)]
struct RunCounts {
    queued: AtomicU64,
    finished: AtomicU64,
}

impl RunCounts {
    /// Counts a run queued; the returned token counts it finished when
    /// dropped, after the routine returned (or unwound), or with the
    /// scheduler item if it is discarded unrun.
    /// True once every run queued before `target` was read has finished.
    fn reached(&self, target: u64) -> bool {
        self.finished.load(Ordering::Acquire) >= target
    }
}

/// Counts a queued run finished when dropped.
struct RunToken {
    inner: Arc<DeviceInner>,
    which: fn(&DeviceInner) -> &RunCounts,
}

impl Drop for RunToken {
    fn drop(&mut self) {
        // Release: a flush that sees the count sees the routine's writes.
        (self.which)(&self.inner)
            .finished
            .fetch_add(1, Ordering::Release);
    }
}

thread_local! {
    /// The devices (by `DeviceInner` address) whose work item this thread
    /// is running, innermost last: a flush of one of them from inside it
    /// would wait for itself.
    static RUNNING_WORK_ITEMS: std::cell::RefCell<Vec<usize>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Marks this thread as running a device's work item until dropped.
struct RunningWorkItem(usize);

impl RunningWorkItem {
    fn enter(inner: &DeviceInner) -> Self {
        let id = std::ptr::from_ref(inner) as usize;
        RUNNING_WORK_ITEMS.with_borrow_mut(|running| running.push(id));
        Self(id)
    }

    fn runs_here(inner: &DeviceInner) -> bool {
        let id = std::ptr::from_ref(inner) as usize;
        RUNNING_WORK_ITEMS.with_borrow(|running| running.contains(&id))
    }
}

impl Drop for RunningWorkItem {
    fn drop(&mut self) {
        RUNNING_WORK_ITEMS.with_borrow_mut(|running| {
            if let Some(at) = running.iter().rposition(|&id| id == self.0) {
                running.remove(at);
            }
        });
    }
}

impl fmt::Debug for DeviceDeferred {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = &self.inner;
        f.debug_struct("DeviceDeferred")
            .field("driver", &inner.driver)
            .field("dpc_queued", &inner.dpc_queued.load(Ordering::Relaxed))
            .field(
                "work_item_queued",
                &inner.work_item_queued.load(Ordering::Relaxed),
            )
            .field("timer", &inner.timer)
            .finish_non_exhaustive()
    }
}

impl DeviceDeferred {
    /// The deferred work of a device whose driver is the service `driver`:
    /// `dpc` runs at DISPATCH_LEVEL, `work_item` at PASSIVE_LEVEL,
    /// `timer` at DISPATCH_LEVEL, each in the driver's context.
    pub fn new(
        scheduler: SchedulerHandle,
        driver: impl Into<Arc<str>>,
        dpc: DeferredRoutine,
        work_item: DeferredRoutine,
        timer: DeferredRoutine,
    ) -> Self {
        let timer_id = scheduler.new_timer();
        Self {
            inner: Arc::new(DeviceInner {
                scheduler,
                driver: driver.into(),
                dpc,
                work_item,
                timer_routine: timer,
                dpc_queued: AtomicBool::new(false),
                work_item_queued: AtomicBool::new(false),
                dpc_runs: RunCounts::default(),
                work_item_runs: RunCounts::default(),
                timer: timer_id,
            }),
        }
    }

    /// The driver (service name) the routines run as.
    pub fn driver(&self) -> &str {
        &self.inner.driver
    }

    /// Runs `f` in the caller's context, or in this device's driver's
    /// context if the caller has none, so IRQL checks always have somewhere
    /// to report.
    fn in_context<R>(&self, f: impl FnOnce() -> R) -> R {
        if context::is_set() {
            f()
        } else {
            let _context = context::enter(Context::driver(
                self.inner.scheduler.verifier().clone(),
                Arc::clone(&self.inner.driver),
            ));
            f()
        }
    }

    /// Queues the DPC unless it is already queued and not yet started;
    /// returns whether it was queued (`KeInsertQueueDpc`). Any IRQL.
    pub fn insert_dpc(&self) -> bool {
        // Callable from an ISR: the closure the queue holds is the host's.
        let _host = crate::alloc_hook::HostCode::enter();
        if self.inner.dpc_queued.swap(true, Ordering::AcqRel) {
            return false;
        }
        let inner = Arc::clone(&self.inner);
        let run = self.inner.queue_run(|inner| &inner.dpc_runs);
        self.inner
            .scheduler
            .queue_dpc(Arc::clone(&self.inner.driver), move || {
                inner.dpc_queued.store(false, Ordering::Release);
                (inner.dpc)();
                drop(run);
            });
        true
    }

    /// Queues the work item unless it is already queued and not yet
    /// started; returns whether it was queued. Above DISPATCH_LEVEL this is
    /// recorded as [`ViolationKind::IrqlTooHigh`] and still done.
    pub fn insert_work_item(&self) -> bool {
        self.in_context(|| irql::check_max("IoQueueWorkItem", Irql::DISPATCH));
        if self.inner.work_item_queued.swap(true, Ordering::AcqRel) {
            return false;
        }
        let inner = Arc::clone(&self.inner);
        let run = self.inner.queue_run(|inner| &inner.work_item_runs);
        self.inner
            .scheduler
            .queue_work_item(Arc::clone(&self.inner.driver), move || {
                inner.work_item_queued.store(false, Ordering::Release);
                let _running = RunningWorkItem::enter(&inner);
                (inner.work_item)();
                drop(run);
            });
        true
    }

    /// True if the DPC is queued and has not started.
    pub fn dpc_queued(&self) -> bool {
        self.inner.dpc_queued.load(Ordering::Acquire)
    }

    /// True if the work item is queued and has not started.
    pub fn work_item_queued(&self) -> bool {
        self.inner.work_item_queued.load(Ordering::Acquire)
    }

    /// What a driver does in release-hardware so that none of its routines
    /// runs after it unloads (`KeCancelTimer`, `KeFlushQueuedDpcs`,
    /// `WdfWorkItemFlush`; KMDF does it for a device's own objects when it
    /// deletes them): cancels the timer, then waits until every run of the
    /// DPC and the work item queued before the call has finished — also a
    /// run already started, as `KeFlushQueuedDpcs` returns only after the
    /// DPC routines "have executed to completion". Runs queued during the
    /// wait are not waited for. In deterministic mode the caller's
    /// processor waits while the others run: the scheduler runs ready
    /// items (seeded, any device's) until those runs are done. In threaded
    /// mode the workers run them (yielding, at most `FLUSH_LIMIT`).
    ///
    /// PASSIVE_LEVEL. A work item that flushes its own device's work item
    /// would wait for itself forever (`WdfWorkItemFlush` must not be called
    /// from the work item's callback): recorded as
    /// [`ViolationKind::Deadlock`],
    /// and that run is not waited for; so is a wait that cannot end.
    pub fn flush(&self) {
        self.in_context(|| irql::check_max("KeFlushQueuedDpcs", Irql::PASSIVE));
        self.inner.scheduler.cancel_timer(self.inner.timer);
        self.wait_for_runs(true);
    }

    /// Waits, as [`DeviceDeferred::flush`] does, for the DPC alone: what
    /// KMDF does for an interrupt's DPC when it disconnects the interrupt
    /// (`KeFlushQueuedDpcs`); the timer and the work item are left alone.
    /// PASSIVE_LEVEL.
    pub fn flush_dpc(&self) {
        self.in_context(|| irql::check_max("KeFlushQueuedDpcs", Irql::PASSIVE));
        self.wait_for_runs(false);
    }

    /// Waits until the runs of the DPC (and, with `work_item`, of the work
    /// item) queued before the call have finished.
    fn wait_for_runs(&self, work_item: bool) {
        let inner = &self.inner;
        let dpc_target = inner.dpc_runs.queued.load(Ordering::Acquire);
        let mut work_target = if work_item {
            inner.work_item_runs.queued.load(Ordering::Acquire)
        } else {
            0
        };
        if work_item && RunningWorkItem::runs_here(inner) {
            self.report_deadlock("WdfWorkItemFlush from the device's own work item");
            // The run in progress (ours) cannot finish first: wait for the
            // others only.
            work_target = work_target.saturating_sub(1);
        }
        let done =
            || inner.dpc_runs.reached(dpc_target) && inner.work_item_runs.reached(work_target);
        if inner.scheduler.mode() == Mode::Deterministic {
            while !done() {
                if !inner.scheduler.run_one_for_waiter() {
                    self.report_deadlock("flush of a DPC or work item nothing left will run");
                    return;
                }
            }
            return;
        }
        let give_up = Instant::now() + FLUSH_LIMIT;
        while !done() {
            if Instant::now() >= give_up {
                self.report_deadlock("flush of a DPC or work item that did not finish in time");
                return;
            }
            std::thread::yield_now();
        }
    }

    /// Records a flush that cannot end, in the caller's context (or the
    /// device's driver's).
    fn report_deadlock(&self, what: &str) {
        self.in_context(|| {
            context::report(ViolationKind::Deadlock {
                what: what.to_owned(),
            });
        });
    }
}

/// How long [`DeviceDeferred::flush`] waits for the workers (threaded mode).
const FLUSH_LIMIT: Duration = Duration::from_secs(10);

impl Deferred for DeviceDeferred {
    fn queue_dpc(&self) {
        self.insert_dpc();
    }

    fn queue_work_item(&self) {
        self.insert_work_item();
    }

    fn set_timer(&self, due_ns: Option<u64>) {
        self.in_context(|| irql::check_max("KeSetTimer", Irql::DISPATCH));
        let scheduler = &self.inner.scheduler;
        match due_ns {
            Some(due_ns) => {
                let routine = Arc::clone(&self.inner.timer_routine);
                scheduler.set_timer(
                    self.inner.timer,
                    Arc::clone(&self.inner.driver),
                    due_ns,
                    move || routine(),
                );
            }
            None => {
                scheduler.cancel_timer(self.inner.timer);
            }
        }
    }

    fn now_ns(&self) -> u64 {
        self.inner.scheduler.now_ns()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::OnceLock;
    use std::sync::atomic::AtomicUsize;

    use super::*;
    use crate::verifier::{Violation, ViolationKind};

    /// A shared log the routines append to.
    #[derive(Clone, Default)]
    struct Log(Arc<Mutex<Vec<String>>>);

    impl Log {
        fn push(&self, entry: impl Into<String>) {
            self.0.lock().unwrap().push(entry.into());
        }
        fn take(&self) -> Vec<String> {
            std::mem::take(&mut self.0.lock().unwrap())
        }
    }

    fn routine(f: impl Fn() + Send + Sync + 'static) -> DeferredRoutine {
        Arc::new(f)
    }

    /// A device whose routines log "<name>:<what>@<irql>".
    fn logging_device(scheduler: &Scheduler, name: &str, log: &Log) -> DeviceDeferred {
        let entry = |what: &'static str| {
            let (log, name) = (log.clone(), name.to_owned());
            routine(move || {
                let driver = context::current_driver().unwrap_or_else(|| "?".into());
                assert_eq!(&*driver, name);
                log.push(format!("{name}:{what}@{:?}", irql::current()));
            })
        };
        DeviceDeferred::new(
            scheduler.handle(),
            name,
            entry("dpc"),
            entry("work"),
            entry("timer"),
        )
    }

    #[test]
    fn dpcs_and_timers_run_at_dispatch_work_items_at_passive() {
        let verifier = Verifier::new();
        let scheduler = Scheduler::deterministic(1, verifier.clone());
        let log = Log::default();
        let device = logging_device(&scheduler, "hcaminiport", &log);
        device.queue_dpc();
        device.queue_work_item();
        device.set_timer(Some(1_000));
        assert_eq!(scheduler.run_until_idle(10), Ok(3));
        let mut entries = log.take();
        entries.sort();
        assert_eq!(
            entries,
            [
                "hcaminiport:dpc@DISPATCH_LEVEL",
                "hcaminiport:timer@DISPATCH_LEVEL",
                "hcaminiport:work@PASSIVE_LEVEL",
            ]
        );
        assert_eq!(irql::current(), Irql::PASSIVE);
        assert!(!context::is_set());
        verifier.assert_clean();
    }

    /// Two threads running the deterministic machine take turns: while
    /// one runs a long work item, the other's `run_until_idle` does not
    /// return (nothing ready, but an item still running, which may queue
    /// more or complete what the caller waits for), and a routine may run
    /// the machine itself (the turn is its thread's already).
    #[test]
    fn a_run_waits_for_another_threads_running_item() {
        let scheduler = Arc::new(Scheduler::deterministic(5, Verifier::new()));
        let done = Arc::new(AtomicBool::new(false));
        let started = Arc::new(AtomicBool::new(false));
        {
            let (done, started, again) = (done.clone(), started.clone(), Arc::clone(&scheduler));
            scheduler.queue_work_item("drv", move || {
                started.store(true, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(100));
                // Running the machine from inside a routine: re-entered.
                assert_eq!(again.run_until_idle(10), Ok(0));
                done.store(true, Ordering::SeqCst);
            });
        }
        let first = {
            let scheduler = Arc::clone(&scheduler);
            std::thread::spawn(move || scheduler.run_until_idle(10))
        };
        while !started.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        assert_eq!(scheduler.run_until_idle(10), Ok(0));
        assert!(
            done.load(Ordering::SeqCst),
            "the run returned only once the other thread's item ended"
        );
        assert_eq!(first.join().unwrap(), Ok(1));
    }

    #[test]
    fn queueing_coalesces_until_the_routine_starts() {
        let verifier = Verifier::new();
        let scheduler = Scheduler::deterministic(7, verifier.clone());
        let runs = Arc::new(AtomicUsize::new(0));
        let requeue = Arc::new(OnceLock::<DeviceDeferred>::new());
        let dpc = {
            let (runs, requeue) = (runs.clone(), requeue.clone());
            routine(move || {
                // The first run queues itself again: allowed, since the
                // DPC was dequeued before its routine started.
                if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                    assert!(requeue.get().unwrap().insert_dpc());
                }
            })
        };
        let nothing = routine(|| {});
        let device = DeviceDeferred::new(
            scheduler.handle(),
            "hcaminiport",
            dpc,
            nothing.clone(),
            nothing,
        );
        requeue.set(device.clone()).unwrap();
        assert!(device.insert_dpc());
        assert!(!device.insert_dpc(), "already queued");
        device.queue_dpc();
        assert!(device.dpc_queued());
        assert!(device.insert_work_item());
        assert!(!device.insert_work_item());
        assert_eq!(
            scheduler.run_until_idle(10),
            Ok(3),
            "dpc, work item, dpc again"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        assert!(!device.dpc_queued() && !device.work_item_queued());
        verifier.assert_clean();
        // Drop the self-reference cycle the test built.
        drop(scheduler);
    }

    #[test]
    fn timers_fire_in_virtual_time_order_and_cancel_works() {
        let verifier = Verifier::new();
        let scheduler = Scheduler::deterministic(3, verifier.clone());
        let log = Log::default();
        let fired = |name: &'static str| {
            let log = log.clone();
            let handle = scheduler.handle();
            move || log.push(format!("{name}@{}", handle.now_ns()))
        };
        let (a, b, c, d) = (
            scheduler.new_timer(),
            scheduler.new_timer(),
            scheduler.new_timer(),
            scheduler.new_timer(),
        );
        scheduler.set_timer(a, "drv", 300, fired("a"));
        scheduler.set_timer(b, "drv", 100, fired("b"));
        scheduler.set_timer(c, "drv", 200, fired("c"));
        assert!(!scheduler.set_timer(d, "drv", 50, fired("d-early")));
        assert!(
            scheduler.set_timer(d, "drv", 250, fired("d")),
            "re-arm replaces"
        );
        assert!(scheduler.cancel_timer(c));
        assert!(!scheduler.cancel_timer(c), "nothing left to cancel");
        assert_eq!(scheduler.run_until_idle(10), Ok(3));
        assert_eq!(log.take(), ["b@100", "d@250", "a@300"]);
        assert_eq!(scheduler.now_ns(), 300);
        verifier.assert_clean();
    }

    #[test]
    fn device_timer_rearm_and_cancel() {
        let verifier = Verifier::new();
        let scheduler = Scheduler::deterministic(3, verifier.clone());
        let log = Log::default();
        let device = logging_device(&scheduler, "drv", &log);
        device.set_timer(Some(500));
        device.set_timer(Some(200));
        assert_eq!(scheduler.run_until_idle(10), Ok(1));
        assert_eq!(scheduler.now_ns(), 200);
        device.set_timer(Some(900));
        device.set_timer(None);
        assert_eq!(scheduler.run_until_idle(10), Ok(0));
        assert_eq!(log.take(), ["drv:timer@DISPATCH_LEVEL"]);
        assert_eq!(device.now_ns(), 200);
        verifier.assert_clean();
    }

    #[test]
    fn time_moves_only_when_idle_or_asked() {
        let verifier = Verifier::new();
        let scheduler = Scheduler::deterministic(5, verifier.clone());
        let log = Log::default();
        let timer = scheduler.new_timer();
        let entry = |what: &'static str| {
            let log = log.clone();
            move || log.push(what)
        };
        scheduler.set_timer(timer, "drv", 1_000, entry("timer"));
        scheduler.schedule_task("step", entry("step"));
        let ran = scheduler.run_one().unwrap().unwrap();
        assert_eq!(
            (ran.kind, &*ran.label, ran.at_ns),
            (ItemKind::Task, "step", 0)
        );
        // Not due within 500 ns: nothing runs, the clock lands on 500.
        assert_eq!(scheduler.run_for(500, 10), Ok(0));
        assert_eq!(scheduler.now_ns(), 500);
        // advance releases the timer but runs nothing.
        scheduler.advance(600).unwrap();
        assert_eq!(log.take(), ["step"]);
        assert_eq!(scheduler.run_for(0, 10), Ok(1));
        assert_eq!(log.take(), ["timer"]);
        assert_eq!(scheduler.now_ns(), 1_100);
        assert_eq!(scheduler.run_one(), Ok(None));
        assert!(scheduler.is_idle());
        verifier.assert_clean();
    }

    /// A mixed workload: three devices, each queueing its DPC from a device
    /// step, the DPC queueing the work item, and a timer; plus independent
    /// device steps. Returns the order things ran in.
    fn mixed_workload(seed: u64) -> Vec<String> {
        let verifier = Verifier::new();
        let scheduler = Scheduler::deterministic(seed, verifier.clone());
        let log = Log::default();
        for n in 0..3 {
            let name = format!("drv{n}");
            let device = Arc::new(OnceLock::<DeviceDeferred>::new());
            let dpc = {
                let (log, device, name) = (log.clone(), device.clone(), name.clone());
                routine(move || {
                    log.push(format!("{name}:dpc"));
                    device.get().unwrap().queue_work_item();
                })
            };
            let work = {
                let (log, name) = (log.clone(), name.clone());
                routine(move || log.push(format!("{name}:work")))
            };
            let timer = {
                let (log, name) = (log.clone(), name.clone());
                routine(move || log.push(format!("{name}:timer")))
            };
            let deferred = DeviceDeferred::new(scheduler.handle(), name.clone(), dpc, work, timer);
            deferred.set_timer(Some(10 * (n + 1)));
            device.set(deferred.clone()).unwrap();
            for step in 0..3 {
                let (log, deferred) = (log.clone(), deferred.clone());
                let label = format!("{name}:step{step}");
                scheduler.schedule_task(label.clone(), move || {
                    log.push(label);
                    deferred.queue_dpc();
                });
            }
        }
        scheduler.run_until_idle(1_000).unwrap();
        verifier.assert_clean();
        log.take()
    }

    #[test]
    fn the_seed_decides_the_interleaving() {
        let first = mixed_workload(42);
        assert_eq!(first, mixed_workload(42), "same seed, same interleaving");
        let mut sorted = first.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(
            sorted.len(),
            3 * 6,
            "every kind of item from every device ran"
        );
        let orders: std::collections::HashSet<_> = (0..8).map(mixed_workload).collect();
        assert!(orders.len() > 1, "different seeds explore different orders");
    }

    #[test]
    fn run_until_idle_reports_a_step_limit() {
        let verifier = Verifier::new();
        let scheduler = Scheduler::deterministic(9, verifier.clone());
        let device = Arc::new(OnceLock::<DeviceDeferred>::new());
        let periodic = {
            let device = device.clone();
            routine(move || {
                let device = device.get().unwrap();
                device.set_timer(Some(device.now_ns() + 1_000));
            })
        };
        let nothing = routine(|| {});
        let deferred = DeviceDeferred::new(
            scheduler.handle(),
            "watchdog",
            nothing.clone(),
            nothing,
            periodic,
        );
        device.set(deferred.clone()).unwrap();
        deferred.set_timer(Some(0));
        assert_eq!(
            scheduler.run_until_idle(50),
            Err(SchedulerError::StepLimit { steps: 50 })
        );
        assert_eq!(scheduler.now_ns(), 49_000);
        assert_eq!(scheduler.run_for(10_000, 100), Ok(10));
        deferred.set_timer(None);
        assert_eq!(scheduler.run_until_idle(50), Ok(0));
        verifier.assert_clean();
    }

    #[test]
    fn queueing_above_dispatch_is_recorded_and_still_done() {
        let verifier = Verifier::new();
        let scheduler = Scheduler::deterministic(2, verifier.clone());
        let log = Log::default();
        let device = logging_device(&scheduler, "hcaminiport", &log);
        {
            // An ISR with no context entered by the caller: the device's
            // own driver is blamed.
            let _isr = IrqlGuard::at(Irql::device(5));
            device.queue_dpc();
            device.queue_work_item();
            device.set_timer(Some(10));
        }
        assert_eq!(scheduler.run_until_idle(10), Ok(3));
        let log: Vec<Violation> = verifier.take();
        let services: Vec<_> = log
            .iter()
            .map(|v| {
                assert_eq!(v.driver.as_deref(), Some("hcaminiport"));
                match v.kind {
                    ViolationKind::IrqlTooHigh {
                        service,
                        at: 5,
                        max: 2,
                    } => service,
                    ref other => panic!("unexpected {other:?}"),
                }
            })
            .collect();
        assert_eq!(services, ["IoQueueWorkItem", "KeSetTimer"]);
    }

    #[test]
    fn a_routine_returning_at_the_wrong_irql_is_blamed_on_its_driver() {
        let verifier = Verifier::new();
        let scheduler = Scheduler::deterministic(2, verifier.clone());
        scheduler.queue_dpc("sloppy", || irql::lower(Irql::PASSIVE));
        assert_eq!(scheduler.run_until_idle(10), Ok(1));
        assert_eq!(irql::current(), Irql::PASSIVE);
        let log = verifier.take();
        assert_eq!(log.len(), 1);
        assert_eq!(log[0].driver.as_deref(), Some("sloppy"));
        assert!(matches!(log[0].kind, ViolationKind::IrqlMismatch { .. }));
    }

    #[test]
    fn a_deterministic_panic_unwinds_to_the_caller_with_state_restored() {
        let scheduler = Scheduler::deterministic(0, Verifier::new());
        scheduler.queue_dpc("crashy", || panic!("boom"));
        let outcome = catch_unwind(AssertUnwindSafe(|| scheduler.run_one()));
        assert!(outcome.is_err());
        assert_eq!(irql::current(), Irql::PASSIVE);
        assert!(!context::is_set());
        assert!(scheduler.is_idle());
    }

    #[test]
    fn operations_of_the_other_mode_are_errors() {
        let deterministic = Scheduler::deterministic(0, Verifier::new());
        assert_eq!(
            deterministic.quiesce(),
            Err(SchedulerError::WrongMode {
                operation: "quiesce",
                mode: Mode::Deterministic
            })
        );
        let threaded = Scheduler::threaded(1, Verifier::new()).unwrap();
        assert!(matches!(
            threaded.run_one(),
            Err(SchedulerError::WrongMode {
                operation: "run_one",
                ..
            })
        ));
        assert!(threaded.advance(1).is_err());
    }

    #[test]
    fn dropping_the_scheduler_discards_queued_work_and_breaks_cycles() {
        let token = Arc::new(());
        let scheduler = Scheduler::deterministic(0, Verifier::new());
        let device = {
            let token = token.clone();
            DeviceDeferred::new(
                scheduler.handle(),
                "drv",
                routine(move || drop(token.clone())),
                routine(|| {}),
                routine(|| {}),
            )
        };
        device.queue_dpc();
        device.set_timer(Some(5));
        let handle = scheduler.handle();
        drop(device);
        drop(scheduler);
        assert_eq!(Arc::strong_count(&token), 1, "the queued DPC was dropped");
        handle.schedule_task("late", || unreachable!("after shutdown"));
        assert!(handle.is_idle());
    }

    #[test]
    fn threaded_mode_runs_everything_exactly_once() {
        const TASKS: usize = 200;
        let verifier = Verifier::new();
        let scheduler = Scheduler::threaded(2, verifier.clone()).unwrap();
        let counts: Arc<Vec<AtomicUsize>> =
            Arc::new((0..TASKS).map(|_| AtomicUsize::new(0)).collect());
        for n in 0..TASKS {
            let counts = counts.clone();
            let count = move |expected: Irql| {
                assert_eq!(irql::current(), expected);
                counts[n].fetch_add(1, Ordering::SeqCst);
            };
            match n % 3 {
                0 => scheduler.queue_dpc("drv", move || count(Irql::DISPATCH)),
                1 => scheduler.queue_work_item("drv", move || count(Irql::PASSIVE)),
                _ => scheduler.schedule_task("step", move || count(Irql::PASSIVE)),
            }
        }
        scheduler.quiesce().unwrap();
        assert!(counts.iter().all(|c| c.load(Ordering::SeqCst) == 1));
        verifier.assert_clean();
    }

    #[test]
    fn threaded_mode_fires_device_deferred_work_and_timers() {
        let verifier = Verifier::new();
        let scheduler = Scheduler::threaded(2, verifier.clone()).unwrap();
        let log = Log::default();
        let device = logging_device(&scheduler, "drv", &log);
        device.set_timer(Some(device.now_ns() + 1_000_000));
        device.queue_dpc();
        device.queue_work_item();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !scheduler.is_idle() {
            assert!(Instant::now() < deadline, "the timer never fired");
            std::thread::sleep(Duration::from_millis(1));
        }
        scheduler.quiesce().unwrap();
        let mut entries = log.take();
        entries.sort();
        assert_eq!(
            entries,
            [
                "drv:dpc@DISPATCH_LEVEL",
                "drv:timer@DISPATCH_LEVEL",
                "drv:work@PASSIVE_LEVEL",
            ]
        );
        verifier.assert_clean();
    }

    #[test]
    fn threaded_mode_reports_a_panic_and_keeps_running() {
        let scheduler = Scheduler::threaded(1, Verifier::new()).unwrap();
        scheduler.schedule_task("crashy", || panic!("boom"));
        assert_eq!(
            scheduler.quiesce(),
            Err(SchedulerError::ItemPanicked {
                label: "crashy".into(),
                message: "boom".into()
            })
        );
        let ran = Arc::new(AtomicBool::new(false));
        let flag = ran.clone();
        scheduler.schedule_task("after", move || flag.store(true, Ordering::SeqCst));
        scheduler.quiesce().unwrap();
        assert!(ran.load(Ordering::SeqCst));
    }

    #[test]
    fn flush_runs_what_is_queued_to_completion_in_deterministic_mode() {
        let verifier = Verifier::new();
        let scheduler = Scheduler::deterministic(5, verifier.clone());
        let log = Log::default();
        let device = logging_device(&scheduler, "drv", &log);
        device.queue_dpc();
        device.queue_work_item();
        device.set_timer(Some(1_000));
        // KeFlushQueuedDpcs / WdfWorkItemFlush: the other processors run
        // the queued routines while the caller waits; the timer is
        // cancelled, not waited for.
        device.flush();
        let mut entries = log.take();
        entries.sort();
        assert_eq!(
            entries,
            ["drv:dpc@DISPATCH_LEVEL", "drv:work@PASSIVE_LEVEL"]
        );
        assert_eq!(
            scheduler.run_until_idle(10),
            Ok(0),
            "the timer was cancelled"
        );
        assert_eq!(irql::current(), Irql::PASSIVE);
        verifier.assert_clean();
    }

    #[test]
    fn flush_waits_for_routines_already_running_in_threaded_mode() {
        let verifier = Verifier::new();
        let scheduler = Scheduler::threaded(2, verifier.clone()).unwrap();
        let started = Arc::new(std::sync::Barrier::new(3));
        let finished = Arc::new(AtomicUsize::new(0));
        let slow = || {
            let (started, finished) = (started.clone(), finished.clone());
            routine(move || {
                started.wait();
                std::thread::sleep(Duration::from_millis(50));
                finished.fetch_add(1, Ordering::SeqCst);
            })
        };
        let device = DeviceDeferred::new(scheduler.handle(), "drv", slow(), slow(), routine(|| {}));
        device.queue_dpc();
        device.queue_work_item();
        // Both routines have started: neither is queued any more.
        started.wait();
        assert!(!device.dpc_queued() && !device.work_item_queued());
        device.flush();
        assert_eq!(
            finished.load(Ordering::SeqCst),
            2,
            "flush returned while a routine was still running"
        );
        scheduler.quiesce().unwrap();
        verifier.assert_clean();
    }

    #[test]
    fn a_work_item_flushing_itself_is_a_deadlock() {
        let verifier = Verifier::new();
        let scheduler = Scheduler::deterministic(2, verifier.clone());
        let me: Arc<OnceLock<DeviceDeferred>> = Arc::default();
        let flushes_itself = {
            let me = me.clone();
            routine(move || me.get().expect("set before queueing").flush())
        };
        let device = DeviceDeferred::new(
            scheduler.handle(),
            "drv",
            routine(|| {}),
            flushes_itself,
            routine(|| {}),
        );
        me.set(device.clone()).unwrap();
        device.queue_work_item();
        assert_eq!(scheduler.run_until_idle(10), Ok(1), "the flush returned");
        let v = verifier.take();
        assert!(
            matches!(&v[..], [x] if x.driver.as_deref() == Some("drv")
                && matches!(&x.kind, ViolationKind::Deadlock { what } if what.contains("WdfWorkItemFlush"))),
            "{v:?}"
        );
        // Break the cycle device -> routine -> OnceLock -> device.
        drop(scheduler);
    }
}
