//! The verifier: every rule a driver breaks is recorded here, with the
//! driver that broke it, and reported after a scenario (Driver Verifier's
//! role). Tests assert the report is empty.
//!
//! Recording never panics and never changes what the host does next: the
//! host goes on with well-defined behaviour (a fault is refused, a double
//! completion is ignored), so one scenario can surface several violations.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::{Arc, Mutex};

/// What rule was broken.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ViolationKind {
    /// Pool memory still allocated when the driver unloaded.
    PoolLeak {
        /// Pool tag.
        tag: [u8; 4],
        /// Bytes leaked.
        bytes: usize,
    },
    /// A DMA mapping or common buffer still live at unload.
    DmaLeak {
        /// What leaked.
        what: String,
    },
    /// An object reference (interface, device, driver) still held at
    /// unload or removal.
    ReferenceLeak {
        /// What is still referenced.
        what: String,
    },
    /// A request was dropped without being completed.
    RequestNotCompleted {
        /// Its I/O control code.
        ioctl: u32,
    },
    /// A request was completed by a driver that did not own it (it was
    /// delivered to another driver, or forwarded on). Completing twice is
    /// not a violation the log can hold: completion consumes the request,
    /// so a second completion does not compile.
    RequestCompletedByNonOwner {
        /// Its I/O control code.
        ioctl: u32,
        /// The driver that completed it.
        by: String,
    },
    /// A request the driver owned from a power-managed queue was neither
    /// completed nor acknowledged (`WdfRequestStopAcknowledge`) after
    /// `EvtIoStop` when its device left D0: KMDF waits for it, so on
    /// Windows the power transition never finishes (bug check 0x9F,
    /// `DRIVER_POWER_STATE_FAILURE`). Recorded after the transition.
    RequestBlocksPowerDown {
        /// Its I/O control code.
        ioctl: u32,
        /// The request (`RequestId::raw`).
        request: u64,
    },
    /// A service was called above the IRQL it allows.
    IrqlTooHigh {
        /// The service.
        service: &'static str,
        /// The IRQL it was called at.
        at: u8,
        /// The highest IRQL it allows.
        max: u8,
    },
    /// IRQL was lowered below the level it was raised from, or a spin lock
    /// was released at a different IRQL than it raised to.
    IrqlMismatch {
        /// What happened.
        detail: String,
    },
    /// The device accessed memory outside a live DMA mapping.
    DmaFault {
        /// The bus address.
        addr: u64,
        /// Bytes.
        len: usize,
    },
    /// A driver was unloaded while referenced.
    UnloadWhileReferenced {
        /// Outstanding references.
        references: usize,
    },
    /// A callback was made into a driver that had unloaded.
    CallbackIntoUnloadedDriver {
        /// The callback.
        callback: String,
    },
    /// A driver routine used more stack than a kernel stack holds
    /// ([`crate::stack`]): on Windows it runs over the guard page and the
    /// machine bugchecks.
    KernelStackOverflow {
        /// The routine (`EvtInterruptIsr`, `DPC`, a PnP callback).
        routine: &'static str,
        /// Bytes it used (at least this many).
        used: usize,
        /// Bytes a routine may use in this build ([`crate::stack::budget`]).
        budget: usize,
    },
    /// A wait that can never end (deterministic mode: nothing left to run
    /// would set the event waited on).
    Deadlock {
        /// What waited.
        what: String,
    },
    /// A driver read or wrote its device's BAR through a mapping it had
    /// given up (after its release-hardware returned: `MmUnmapIoSpace`),
    /// which on Windows touches whatever the address maps to next.
    BarAccessAfterUnmap {
        /// The offset in the BAR.
        offset: u64,
    },
    /// A driver reached into a user process's memory (probed or locked a
    /// user buffer, mapped or unmapped a page in it) outside that
    /// process's context: from another process's thread, a DPC, a work
    /// item, or a request delivered after it left its issuing thread
    /// (held across sleep). On Windows the address means something else
    /// there, or nothing.
    UserMemoryOutsideProcessContext {
        /// The process whose memory was reached.
        pid: u32,
        /// The process whose context the thread was in, if any.
        current: Option<u32>,
        /// The service used.
        service: &'static str,
    },
    /// A process exited with user pages still locked by the driver named
    /// (`PROCESS_HAS_LOCKED_PAGES`, bugcheck 0x76).
    ProcessHasLockedPages {
        /// The exiting process.
        pid: u32,
        /// Pages the driver still holds locked.
        pages: usize,
    },
    /// Anything else the host model checks (PnP or power protocol).
    Protocol {
        /// What happened.
        detail: String,
    },
}

/// One recorded violation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The driver (service name) responsible, if known.
    pub driver: Option<String>,
    /// What it did.
    pub kind: ViolationKind,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.driver {
            Some(d) => write!(f, "{d}: {:?}", self.kind),
            None => write!(f, "{:?}", self.kind),
        }
    }
}

/// The shared violation log of one host, and the set of driver images
/// that have unloaded (Driver Verifier's
/// `DRIVER_UNLOADED_WITHOUT_CANCELLING_PENDING_OPERATIONS` check: a DPC,
/// timer, work item or interface call that reaches an unloaded driver).
#[derive(Debug, Clone, Default)]
pub struct Verifier {
    log: Arc<Mutex<Vec<Violation>>>,
    unloaded: Arc<Mutex<BTreeSet<String>>>,
}

impl Verifier {
    /// An empty log.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a violation.
    pub fn report(&self, driver: Option<&str>, kind: ViolationKind) {
        // The log is the host's, also when a driver breaks a rule at DIRQL.
        let _host = crate::alloc_hook::HostCode::enter();
        let v = Violation {
            driver: driver.map(str::to_owned),
            kind,
        };
        self.log.lock().unwrap_or_else(|e| e.into_inner()).push(v);
    }

    /// Records that `driver`'s image is loaded (again).
    pub fn driver_loaded(&self, driver: &str) {
        self.unloaded
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(driver);
    }

    /// Records that `driver`'s image has unloaded.
    pub fn driver_unloaded(&self, driver: &str) {
        self.unloaded
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(driver.to_owned());
    }

    /// Checks, before running it, that `callback` does not enter an
    /// unloaded driver; reports `CallbackIntoUnloadedDriver` and returns
    /// false if it would.
    pub fn check_callback(&self, driver: &str, callback: &str) -> bool {
        let unloaded = self
            .unloaded
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(driver);
        if unloaded {
            self.report(
                Some(driver),
                ViolationKind::CallbackIntoUnloadedDriver {
                    callback: callback.to_owned(),
                },
            );
        }
        !unloaded
    }

    /// Every violation so far.
    pub fn violations(&self) -> Vec<Violation> {
        self.log.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Takes the violations so far, leaving the log empty.
    pub fn take(&self) -> Vec<Violation> {
        std::mem::take(&mut *self.log.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Panics with every violation listed, if there are any: the assertion
    /// each scenario test ends with.
    #[track_caller]
    pub fn assert_clean(&self) {
        let v = self.violations();
        assert!(
            v.is_empty(),
            "verifier violations:\n{}",
            v.iter()
                .map(|v| format!("  {v}"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_and_reports() {
        let v = Verifier::new();
        v.assert_clean();
        v.report(
            Some("hcaminiport"),
            ViolationKind::RequestNotCompleted { ioctl: 7 },
        );
        let clone = v.clone();
        assert_eq!(clone.violations().len(), 1, "clones share the log");
        let text = format!("{}", v.violations()[0]);
        assert!(text.starts_with("hcaminiport: RequestNotCompleted"));
        assert_eq!(v.take().len(), 1);
        v.assert_clean();
    }

    #[test]
    #[should_panic(expected = "verifier violations")]
    fn assert_clean_lists_violations() {
        let v = Verifier::new();
        v.report(
            None,
            ViolationKind::DmaFault {
                addr: 0x1000,
                len: 4,
            },
        );
        v.assert_clean();
    }
}
