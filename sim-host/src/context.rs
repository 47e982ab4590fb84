//! Who is running: the execution context the host sets around every call
//! into a driver.
//!
//! Contract: before the host calls a driver (a PnP or power callback, a
//! request, its DPC, work item or timer routine) it [`enter`]s a
//! [`Context`] naming the [`Verifier`] of the host and the driver's service
//! name; when the call returns the returned [`ContextGuard`] restores what
//! was there before. Contexts nest (a driver calling down into another
//! driver, or a DPC run from inside host code), each guard restoring its
//! predecessor, so they must be dropped in reverse order of entering — which
//! scoped guards do by construction.
//!
//! Anything that detects a broken rule while a driver runs calls
//! [`report`], which attributes the violation to the current driver. With no
//! context set (host code outside any driver call, or a unit test of a
//! single module) [`report`] does nothing: violations are recorded only
//! where there is a verifier to record them in.
//!
//! The context is per thread, like the IRQL ([`crate::irql`]): a worker
//! thread of the threaded scheduler runs each item inside the item's own
//! context.

use std::cell::RefCell;
use std::marker::PhantomData;
use std::sync::Arc;

use crate::verifier::{Verifier, ViolationKind};

/// The execution context of the calling thread: where violations go and
/// which driver they are charged to.
#[derive(Debug, Clone)]
pub struct Context {
    /// The host's violation log.
    pub verifier: Verifier,
    /// The service name of the driver running, or `None` for the host's own
    /// code (stepping the device, the PnP manager between callbacks).
    pub driver: Option<Arc<str>>,
}

impl Context {
    /// The context of a call into the driver registered as `service`.
    pub fn driver(verifier: Verifier, service: impl Into<Arc<str>>) -> Self {
        Self {
            verifier,
            driver: Some(service.into()),
        }
    }

    /// The context of the host's own code: violations are recorded without
    /// a driver to blame.
    pub fn host(verifier: Verifier) -> Self {
        Self {
            verifier,
            driver: None,
        }
    }

    /// Records `kind` against this context's driver.
    pub fn report(&self, kind: ViolationKind) {
        self.verifier.report(self.driver.as_deref(), kind);
    }
}

thread_local! {
    /// The context of this thread, if the host has entered one.
    static CURRENT: RefCell<Option<Context>> = const { RefCell::new(None) };
}

/// Restores the previous context of this thread when dropped.
///
/// Not `Send`: the context it restores belongs to the thread that entered.
#[derive(Debug)]
#[must_use = "the context is left as soon as the guard is dropped"]
pub struct ContextGuard {
    /// The context that was current before [`enter`].
    previous: Option<Context>,
    /// Whether the thread ran driver code before [`enter`]
    /// ([`crate::alloc_hook`]).
    previous_in_driver: bool,
    /// Pins the guard to the entering thread.
    _not_send: PhantomData<*const ()>,
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        // A heap call the driver made above DISPATCH_LEVEL and no IRQL
        // guard has reported yet is charged to it while it is still current.
        crate::alloc_hook::report_pending();
        let previous = self.previous.take();
        CURRENT.with_borrow_mut(|current| *current = previous);
        crate::alloc_hook::set_in_driver(self.previous_in_driver);
    }
}

/// Makes `context` the calling thread's context until the guard drops.
pub fn enter(context: Context) -> ContextGuard {
    let previous_in_driver = crate::alloc_hook::set_in_driver(context.driver.is_some());
    let previous = CURRENT.with_borrow_mut(|current| current.replace(context));
    ContextGuard {
        previous,
        previous_in_driver,
        _not_send: PhantomData,
    }
}

/// The calling thread's context, if one is entered.
pub fn current() -> Option<Context> {
    CURRENT.with_borrow(Clone::clone)
}

/// True if the calling thread has a context.
pub fn is_set() -> bool {
    CURRENT.with_borrow(Option::is_some)
}

/// The service name of the driver running on this thread, if any.
pub fn current_driver() -> Option<Arc<str>> {
    CURRENT.with_borrow(|current| current.as_ref().and_then(|c| c.driver.clone()))
}

/// Records `kind` against the current driver; does nothing without a
/// context.
pub fn report(kind: ViolationKind) {
    // Clone out first so the verifier's lock is never taken while the
    // thread-local is borrowed.
    if let Some(context) = current() {
        context.report(kind);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn protocol(detail: &str) -> ViolationKind {
        ViolationKind::Protocol {
            detail: detail.to_owned(),
        }
    }

    #[test]
    fn report_without_context_is_a_no_op() {
        assert!(!is_set());
        assert_eq!(current_driver(), None);
        report(protocol("nobody listens"));
    }

    #[test]
    fn report_is_attributed_to_the_current_driver() {
        let verifier = Verifier::new();
        {
            let _guard = enter(Context::driver(verifier.clone(), "hcaminiport"));
            assert_eq!(current_driver().as_deref(), Some("hcaminiport"));
            report(protocol("broken"));
        }
        assert!(!is_set(), "the guard restores the empty context");
        let violations = verifier.take();
        assert_eq!(violations.len(), 1);
        assert_eq!(violations[0].driver.as_deref(), Some("hcaminiport"));
        assert_eq!(violations[0].kind, protocol("broken"));
    }

    #[test]
    fn contexts_nest_and_restore() {
        let verifier = Verifier::new();
        let _host = enter(Context::host(verifier.clone()));
        report(protocol("host"));
        {
            let _bus = enter(Context::driver(verifier.clone(), "ibalbus"));
            {
                let _miniport = enter(Context::driver(verifier.clone(), "hcaminiport"));
                report(protocol("inner"));
            }
            assert_eq!(current_driver().as_deref(), Some("ibalbus"));
            report(protocol("outer"));
        }
        assert!(is_set());
        assert_eq!(current_driver(), None);
        let drivers: Vec<_> = verifier.take().into_iter().map(|v| v.driver).collect();
        assert_eq!(
            drivers,
            [None, Some("hcaminiport".into()), Some("ibalbus".into())]
        );
    }

    #[test]
    fn contexts_are_per_thread() {
        let verifier = Verifier::new();
        let _guard = enter(Context::driver(verifier.clone(), "hcaminiport"));
        std::thread::spawn(|| {
            assert!(!is_set());
            report(protocol("other thread, no context"));
        })
        .join()
        .unwrap();
        verifier.assert_clean();
    }
}
