//! A fault-injecting wrapper around any provider (cargo feature
//! `fault-injection`, for tests only: the shipped DLL never has it), so the
//! access library's tests can force every row of guide Table 10-1:
//!
//! | row | pre | IOCTL | post | how |
//! |---|---|---|---|---|
//! | 1 | ok | ok | ok | no fault |
//! | 2 | ok | ok | fails | [`Fault::FailPost`]: the inner post runs (and builds its object), then the wrapper answers the status; the library must destroy the created object |
//! | 3 | ok | fails | fails | any input the kernel refuses; [`Fault::PostClaimsSuccess`] makes a buggy plug-in that answers `Ok` there, which the library must catch |
//! | 4 | fails | not done | not done | [`Fault::FailPre`]: the inner pre is not called, so nothing is allocated |
//!
//! Faults are armed per verb and fire once each, in the order armed. Every
//! hook call is recorded ([`HookEvent`]) so a test can check that post ran
//! exactly when the IOCTL did, and saw its status.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use ib_types::cq::CqNotify;
use ib_types::ioctl::VerbId;
use ib_types::status::IbStatus;
use ib_types::uvp::{PostCall, PostRefused, PreCall, PreOutcome, UserSend, UserVerbsProvider};
use ib_types::wc::WorkCompletion;
use ib_types::wr::RecvWr;

/// One armed fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The next pre of the verb fails with this status (row 4).
    FailPre(IbStatus),
    /// The next post of the verb runs the inner post, then fails with this
    /// status (row 2 after a successful IOCTL).
    FailPost(IbStatus),
    /// The next post of the verb answers `Ok` whatever happened: after a
    /// failed IOCTL that breaks row 3, and the library must notice.
    PostClaimsSuccess,
}

/// A hook call the wrapper saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HookEvent {
    /// A pre and what it answered (`Ok(true)`: IOCTL to follow,
    /// `Ok(false)`: completed in user mode).
    Pre {
        /// The verb.
        verb: VerbId,
        /// The answer.
        result: Result<bool, IbStatus>,
    },
    /// A post: the IOCTL's status it saw, and what it answered.
    Post {
        /// The verb.
        verb: VerbId,
        /// The IOCTL's status.
        ioctl: IbStatus,
        /// The answer.
        result: Result<(), IbStatus>,
    },
}

/// `inner` with faults on demand.
#[derive(Debug)]
pub struct FaultInjector<P> {
    inner: P,
    armed: Mutex<HashMap<VerbId, VecDeque<Fault>>>,
    events: Mutex<Vec<HookEvent>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<P> FaultInjector<P> {
    /// `inner`, no fault armed.
    pub fn new(inner: P) -> Self {
        Self {
            inner,
            armed: Mutex::default(),
            events: Mutex::default(),
        }
    }

    /// The wrapped provider.
    pub fn inner(&self) -> &P {
        &self.inner
    }

    /// Arms `fault` for the next matching hook of `verb`.
    pub fn arm(&self, verb: VerbId, fault: Fault) {
        lock(&self.armed).entry(verb).or_default().push_back(fault);
    }

    /// The hook calls so far, and forgets them.
    pub fn take_events(&self) -> Vec<HookEvent> {
        core::mem::take(&mut *lock(&self.events))
    }

    /// The first armed fault of `verb` that `wanted` accepts, removed.
    fn fire(&self, verb: VerbId, wanted: impl Fn(&Fault) -> bool) -> Option<Fault> {
        let mut armed = lock(&self.armed);
        let queue = armed.get_mut(&verb)?;
        let at = queue.iter().position(wanted)?;
        queue.remove(at)
    }
}

impl<P: UserVerbsProvider> UserVerbsProvider for FaultInjector<P> {
    fn pre(&self, call: &mut PreCall<'_>) -> Result<PreOutcome, IbStatus> {
        let result = match self.fire(call.verb, |f| matches!(f, Fault::FailPre(_))) {
            Some(Fault::FailPre(status)) => Err(status),
            _ => self.inner.pre(call),
        };
        lock(&self.events).push(HookEvent::Pre {
            verb: call.verb,
            result: result.map(|o| matches!(o, PreOutcome::Ioctl { .. })),
        });
        result
    }

    fn post(&self, call: &PostCall<'_>) -> Result<(), IbStatus> {
        let fault = self.fire(call.verb, |f| !matches!(f, Fault::FailPre(_)));
        let inner = self.inner.post(call);
        let result = match fault {
            Some(Fault::FailPost(status)) => Err(status),
            Some(Fault::PostClaimsSuccess) => Ok(()),
            _ => inner,
        };
        lock(&self.events).push(HookEvent::Post {
            verb: call.verb,
            ioctl: call.status,
            result,
        });
        result
    }

    fn post_send(&self, qp: u64, wrs: &[UserSend<'_>]) -> Result<usize, PostRefused> {
        self.inner.post_send(qp, wrs)
    }

    fn post_recv(&self, qp: u64, wrs: &[RecvWr<'_>]) -> Result<usize, PostRefused> {
        self.inner.post_recv(qp, wrs)
    }

    fn post_srq_recv(&self, srq: u64, wrs: &[RecvWr<'_>]) -> Result<usize, PostRefused> {
        self.inner.post_srq_recv(srq, wrs)
    }

    fn poll_cq(&self, cq: u64, out: &mut [WorkCompletion]) -> Result<usize, IbStatus> {
        self.inner.poll_cq(cq, out)
    }

    fn arm_cq(&self, cq: u64, notify: CqNotify) -> Result<(), IbStatus> {
        self.inner.arm_cq(cq, notify)
    }
}
