//! Events (`KEVENT`, notification type): the simulated platform's
//! [`driver_platform::Event`].
//!
//! Contract (the Windows rules it enforces):
//! - [`HostEvent::set`] and [`HostEvent::clear`] at DISPATCH_LEVEL or
//!   below; above is an `IrqlTooHigh` violation (`KeSetEvent`), and the
//!   call is still carried out.
//! - [`HostEvent::wait`] at PASSIVE_LEVEL only (`KeWaitForSingleObject`
//!   with no timeout): a wait at DISPATCH_LEVEL or above is an
//!   `IrqlTooHigh` violation and returns at once without waiting (on
//!   Windows it would hang or bug-check the machine).
//! - In threaded mode a wait blocks the calling thread until another
//!   thread sets the event. In deterministic mode everything runs on one
//!   thread, so the waiter *is* the scheduler: the wait runs the other
//!   "processors'" items ([`SchedulerHandle`], seeded as usual) until the
//!   event is set. If nothing is left that could set it, the wait would
//!   last forever: that is recorded as a `Deadlock` violation and the
//!   wait returns. The waiter must hold no lock the items it runs need (on
//!   Windows a PASSIVE_LEVEL waiter holds no spin lock either; a mutex it
//!   holds would deadlock there too).

use std::sync::{Arc, Condvar, Mutex, PoisonError};

use driver_platform::{Event, Irql};

use crate::context;
use crate::irql::check_max;
use crate::sched::SchedulerHandle;
use crate::verifier::ViolationKind;

#[derive(Debug, Default)]
struct State {
    set: Mutex<bool>,
    changed: Condvar,
}

/// A notification event of the simulated host. Cloning shares the event.
#[derive(Debug, Clone)]
pub struct HostEvent {
    state: Arc<State>,
    sched: SchedulerHandle,
}

impl HostEvent {
    /// A cleared event whose waiters run (deterministic mode) or wait for
    /// (threaded mode) the items of `sched`.
    pub fn new(sched: SchedulerHandle) -> Self {
        Self {
            state: Arc::default(),
            sched,
        }
    }

    fn flag(&self) -> std::sync::MutexGuard<'_, bool> {
        self.state
            .set
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl Event for HostEvent {
    fn set(&self) {
        check_max("KeSetEvent", Irql::DISPATCH);
        *self.flag() = true;
        self.state.changed.notify_all();
    }

    fn clear(&self) {
        check_max("KeClearEvent", Irql::DISPATCH);
        *self.flag() = false;
    }

    fn is_set(&self) -> bool {
        check_max("KeReadStateEvent", Irql::DISPATCH);
        *self.flag()
    }

    fn wait(&self) {
        if !check_max("KeWaitForSingleObject", Irql::PASSIVE) {
            return;
        }
        if self.sched.mode() == crate::sched::Mode::Deterministic {
            while !*self.flag() {
                if !self.sched.run_one_for_waiter() {
                    // Recorded even outside a driver's context (a test
                    // thread waiting): the host's own log always sees it.
                    self.sched.verifier().report(
                        context::current_driver().as_deref(),
                        ViolationKind::Deadlock {
                            what: "KeWaitForSingleObject on an event nothing left to run will set"
                                .to_owned(),
                        },
                    );
                    return;
                }
            }
            return;
        }
        let mut set = self.flag();
        while !*set {
            set = self
                .state
                .changed
                .wait(set)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::Context;
    use crate::irql::IrqlGuard;
    use crate::sched::Scheduler;
    use crate::verifier::Verifier;

    #[test]
    fn a_deterministic_wait_runs_the_other_processors_until_the_event_is_set() {
        let verifier = Verifier::new();
        let sched = Scheduler::deterministic(3, verifier.clone());
        let event = HostEvent::new(sched.handle());
        let (setter, handle) = (event.clone(), sched.handle());
        // The setter is two hops away: a DPC that queues another DPC.
        sched.queue_dpc("drv", move || {
            handle.queue_dpc("drv", move || {
                assert_eq!(crate::irql::current(), Irql::DISPATCH);
                setter.set();
            });
        });
        assert!(!event.is_set());
        event.wait();
        assert!(event.is_set());
        // A set event releases a later wait at once; a cleared one does not.
        event.wait();
        event.clear();
        assert!(!event.is_set());
        verifier.assert_clean();
    }

    #[test]
    fn a_wait_nothing_can_end_is_a_deadlock_and_returns() {
        let verifier = Verifier::new();
        let sched = Scheduler::deterministic(4, verifier.clone());
        let event = HostEvent::new(sched.handle());
        event.wait();
        let violations = verifier.violations();
        assert_eq!(violations.len(), 1, "{violations:?}");
        assert!(matches!(violations[0].kind, ViolationKind::Deadlock { .. }));
    }

    #[test]
    fn a_wait_at_dispatch_level_is_refused_and_recorded() {
        let verifier = Verifier::new();
        let sched = Scheduler::deterministic(5, verifier.clone());
        let event = HostEvent::new(sched.handle());
        let (setter, waiter) = (event.clone(), event.clone());
        sched.queue_dpc("drv", move || {
            // Returns at once instead of hanging the processor.
            waiter.wait();
            setter.set();
        });
        sched.run_until_idle(10).unwrap();
        assert!(event.is_set());
        let violations = verifier.violations();
        assert_eq!(violations.len(), 1, "{violations:?}");
        assert_eq!(violations[0].driver.as_deref(), Some("drv"));
        assert!(matches!(
            violations[0].kind,
            ViolationKind::IrqlTooHigh {
                service: "KeWaitForSingleObject",
                at: 2,
                max: 0
            }
        ));
    }

    #[test]
    fn setting_above_dispatch_level_is_recorded() {
        let verifier = Verifier::new();
        let sched = Scheduler::deterministic(6, verifier.clone());
        let event = HostEvent::new(sched.handle());
        {
            let _context = context::enter(Context::driver(verifier.clone(), "drv"));
            let _irql = IrqlGuard::switched(Irql::device(5));
            event.set();
        }
        assert!(event.is_set());
        assert!(matches!(
            verifier.violations()[0].kind,
            ViolationKind::IrqlTooHigh {
                service: "KeSetEvent",
                ..
            }
        ));
    }

    #[test]
    fn a_threaded_wait_blocks_until_a_worker_sets_the_event() {
        let verifier = Verifier::new();
        let sched = Scheduler::threaded(2, verifier.clone()).unwrap();
        let event = HostEvent::new(sched.handle());
        let setter = event.clone();
        sched.queue_dpc("drv", move || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            setter.set();
        });
        event.wait();
        assert!(event.is_set());
        sched.quiesce().unwrap();
        verifier.assert_clean();
    }
}
