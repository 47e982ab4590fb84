//! File objects, process handles and process context, shown with a small
//! sample function driver (and an upper filter) on one device: the order
//! of CREATE, CLEANUP and CLOSE, requests carrying their file object,
//! process exit cancelling pending requests before CLEANUP, open handles
//! vetoing query-remove; and deliberately broken variants of the driver
//! that the verifier catches: user pages locked outside the caller's
//! context (from a DPC, or from a request held across sleep and delivered
//! on resume) and pages still locked when the process exits
//! (`PROCESS_HAS_LOCKED_PAGES`).

use std::sync::{Arc, Mutex};

use driver_platform::{MemoryLocker, Request, RequestorMode, SystemPowerState};
use ib_types::status::NtStatus;
use sim_host::dma::{HostLockedPages, HostLocker};
use sim_host::driver::{
    CANCELLED, DeviceCallbacks, DeviceInit, DriverEntry, Forward, SUCCESS, StackRole,
};
use sim_host::file::FileObject;
use sim_host::memory::{AddressSpace, Process};
use sim_host::pnp::{Binder, DevNodeId, DeviceServices, PnpManager, StackPlan};
use sim_host::request::HostRequest;
use sim_host::sched::{Scheduler, SchedulerHandle};
use sim_host::verifier::{Verifier, ViolationKind};

/// Input: the user address of one page to lock for the file.
const IOCTL_LOCK: u32 = 0x0022_2000;
/// Kept pending until cleanup (or cancelled).
const IOCTL_HOLD: u32 = 0x0022_2004;
/// Locks the user page at the input's address in `EvtIoInCallerContext`
/// and keeps it for the file when the queue presents the request.
const IOCTL_LOCK_IN_CALLER: u32 = 0x0022_2008;

const FUNCTION: &str = "samplefile";
const FILTER: &str = "samplefilefilter";

type Log = Arc<Mutex<Vec<String>>>;

fn log(l: &Log, s: impl Into<String>) {
    l.lock().unwrap().push(s.into());
}

struct OneDeviceBinder;

impl Binder for OneDeviceBinder {
    fn bind(&self, _path: &str, hw: &[String], _compat: &[String]) -> Result<StackPlan, String> {
        match hw.first().map(String::as_str) {
            Some("TEST\\FILEDEV") => Ok(StackPlan {
                function: FUNCTION.into(),
                upper_filters: vec![FILTER.into()],
                lower_filters: vec![],
                security: None,
            }),
            other => Err(format!("no INF matches {other:?}")),
        }
    }
}

/// How the sample function driver is broken, if it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Breakage {
    /// Locks in the caller's context, unlocks at cleanup.
    None,
    /// Locks the user page from a DPC it queues for the request.
    LockFromDpc,
    /// Keeps the locked pages past cleanup (in a driver-wide list).
    KeepLockedPastCleanup,
}

/// The per-file-object context: the pages locked for the file.
#[derive(Default)]
struct FileContext {
    locked: Mutex<Vec<HostLockedPages>>,
}

struct SampleDevice {
    log: Log,
    breakage: Breakage,
    kernel: AddressSpace,
    sched: SchedulerHandle,
    held: Mutex<Vec<HostRequest>>,
    /// Where the broken driver keeps pages past cleanup.
    kept: Arc<Mutex<Vec<HostLockedPages>>>,
}

impl SampleDevice {
    fn note(&self, what: &str, file: &FileObject) {
        let in_process = sim_host::caller::in_process(file.process());
        log(
            &self.log,
            format!(
                "{FUNCTION}:{what} file {} in process {in_process}",
                file.id()
            ),
        );
    }

    fn lock_user_page(
        process: &Process,
        kernel: &AddressSpace,
        va: u64,
    ) -> Option<HostLockedPages> {
        HostLocker::new(kernel, Some(process))
            .lock(RequestorMode::User, va, 4096, false)
            .ok()
    }
}

impl DeviceCallbacks for SampleDevice {
    fn file_create(&self, file: &FileObject) -> NtStatus {
        self.note("create", file);
        file.set_context(FileContext::default());
        SUCCESS
    }

    fn file_cleanup(&self, file: &FileObject) {
        self.note("cleanup", file);
        // IRP_MJ_CLEANUP: complete what is queued for this file object.
        let mine: Vec<HostRequest> = {
            let mut held = self.held.lock().unwrap();
            let (mine, others) = held
                .drain(..)
                .partition(|r| r.file().is_some_and(|f| f.id() == file.id()));
            *held = others;
            mine
        };
        for req in mine {
            log(
                &self.log,
                format!("{FUNCTION}:held request canceled {}", req.is_canceled()),
            );
            req.complete(CANCELLED, 0);
        }
        if let Some(context) = file.context::<FileContext>() {
            let pages = std::mem::take(&mut *context.locked.lock().unwrap());
            if self.breakage == Breakage::KeepLockedPastCleanup {
                self.kept.lock().unwrap().extend(pages);
            }
        }
    }

    fn file_close(&self, file: &FileObject) {
        self.note("close", file);
    }

    fn io_in_caller_context(&self, mut req: HostRequest) -> Option<HostRequest> {
        // The KMDF pattern: probe and lock in the issuing thread, keep the
        // lock in the request's context, then enqueue.
        if req.ioctl_code() == IOCTL_LOCK_IN_CALLER
            && let Some(process) = req.process().cloned()
        {
            let va = u64::from_le_bytes(req.input()[..8].try_into().unwrap());
            if let Some(pages) = Self::lock_user_page(&process, &self.kernel, va) {
                req.set_context(pages);
            }
        }
        Some(req)
    }

    fn io_request(&self, _lower: &dyn Forward, mut req: HostRequest) {
        let Some(file) = req.file().cloned() else {
            return req.complete(NtStatus::from_raw(0xC000_0010), 0);
        };
        match req.ioctl_code() {
            IOCTL_LOCK_IN_CALLER => {
                // Only what was locked in the caller's context is used.
                let pages = req.take_context::<HostLockedPages>();
                let ok = pages.is_some();
                if let Some(context) = file.context::<FileContext>() {
                    context.locked.lock().unwrap().extend(pages);
                }
                req.complete(if ok { SUCCESS } else { CANCELLED }, 0);
            }
            IOCTL_LOCK => {
                let va = u64::from_le_bytes(req.input()[..8].try_into().unwrap());
                let process = file.process().clone();
                if self.breakage == Breakage::LockFromDpc {
                    // Broken: the user address is used from a DPC, in
                    // whatever process the processor happens to run.
                    let kernel = self.kernel.clone();
                    self.sched.queue_dpc(FUNCTION, move || {
                        let pages = Self::lock_user_page(&process, &kernel, va);
                        if let Some(context) = file.context::<FileContext>() {
                            context.locked.lock().unwrap().extend(pages);
                        }
                        req.complete(SUCCESS, 0);
                    });
                    return;
                }
                let pages = Self::lock_user_page(&process, &self.kernel, va);
                let ok = pages.is_some();
                if let Some(context) = file.context::<FileContext>() {
                    context.locked.lock().unwrap().extend(pages);
                }
                req.complete(if ok { SUCCESS } else { CANCELLED }, 0);
            }
            IOCTL_HOLD => self.held.lock().unwrap().push(req),
            _ => req.complete(NtStatus::from_raw(0xC000_0010), 0),
        }
    }
}

/// A filter that only logs the file callbacks it sees.
struct SampleFilter(Log);

impl DeviceCallbacks for SampleFilter {
    fn file_create(&self, file: &FileObject) -> NtStatus {
        log(&self.0, format!("{FILTER}:create file {}", file.id()));
        SUCCESS
    }
    fn file_cleanup(&self, file: &FileObject) {
        log(&self.0, format!("{FILTER}:cleanup file {}", file.id()));
    }
    fn file_close(&self, file: &FileObject) {
        log(&self.0, format!("{FILTER}:close file {}", file.id()));
    }
    fn power_managed_queue(&self) -> bool {
        false
    }
}

struct SampleDriver {
    log: Log,
    breakage: Breakage,
    sched: SchedulerHandle,
    kept: Arc<Mutex<Vec<HostLockedPages>>>,
}

impl DriverEntry for SampleDriver {
    fn add_device(
        &self,
        init: &DeviceInit,
        _host: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        Ok(match init.role {
            StackRole::UpperFilter => Arc::new(SampleFilter(self.log.clone())),
            _ => Arc::new(SampleDevice {
                log: self.log.clone(),
                breakage: self.breakage,
                kernel: AddressSpace::kernel(),
                sched: self.sched.clone(),
                held: Mutex::default(),
                kept: self.kept.clone(),
            }),
        })
    }
}

struct NoPdoCallbacks;
impl DeviceCallbacks for NoPdoCallbacks {}

struct World {
    pnp: PnpManager,
    verifier: Verifier,
    sched: Scheduler,
    log: Log,
    device: DevNodeId,
    kept: Arc<Mutex<Vec<HostLockedPages>>>,
}

fn world(breakage: Breakage) -> World {
    let verifier = Verifier::new();
    let sched = Scheduler::deterministic(5, verifier.clone());
    let pnp = PnpManager::new(verifier.clone(), Box::new(OneDeviceBinder));
    let log: Log = Arc::default();
    let kept: Arc<Mutex<Vec<HostLockedPages>>> = Arc::default();
    let driver = Arc::new(SampleDriver {
        log: log.clone(),
        breakage,
        sched: sched.handle(),
        kept: kept.clone(),
    });
    pnp.register_driver(FUNCTION, driver.clone());
    pnp.register_driver(FILTER, driver);
    let device = pnp.add_device(
        None,
        "ROOT\\FILEDEV\\0000",
        vec!["TEST\\FILEDEV".into()],
        vec![],
        Arc::new(NoPdoCallbacks),
    );
    World {
        pnp,
        verifier,
        sched,
        log,
        device,
        kept,
    }
}

fn taken(l: &Log) -> Vec<String> {
    std::mem::take(&mut *l.lock().unwrap())
}

fn lock_request(va: u64) -> Vec<u8> {
    va.to_le_bytes().to_vec()
}

#[test]
fn a_handle_goes_create_then_cleanup_then_close_once_its_requests_are_done() {
    let w = world(Breakage::None);
    let process = Process::new(31);
    let handle = w.pnp.open_file(&process, w.device).unwrap();
    let id = handle.file().id();
    // CREATE top-down (filter, then function driver), in the process.
    assert_eq!(
        taken(&w.log),
        [
            format!("{FILTER}:create file {id}"),
            format!("{FUNCTION}:create file {id} in process true"),
        ]
    );
    assert_eq!(w.pnp.open_handle_count(w.device), 1);
    assert_eq!(w.pnp.process_handle_count(&process), 1);

    // A request on the handle carries the file object; the driver locks
    // the user page in the caller's context.
    let va = process.alloc(4096).unwrap();
    let done = handle.send(IOCTL_LOCK, lock_request(va), 0);
    assert_eq!(done.completion().unwrap().status, SUCCESS);
    assert_eq!(process.space().locked_pages(), 1);

    // An open handle vetoes query-remove.
    let veto = w.pnp.query_and_remove(w.device).unwrap_err();
    assert_eq!(veto.service, "host (1 open handle(s))", "{veto}");

    // A duplicate keeps the file object open; the last close cleans up.
    let pending = handle.send(IOCTL_HOLD, vec![], 0);
    let dup = handle.duplicate();
    handle.close();
    assert!(taken(&w.log).is_empty(), "one handle is still open");
    dup.close();
    assert_eq!(
        taken(&w.log),
        [
            format!("{FILTER}:cleanup file {id}"),
            format!("{FUNCTION}:cleanup file {id} in process true"),
            format!("{FUNCTION}:held request canceled false"),
            // The held request completed at cleanup: its reference went
            // with it, so CLOSE follows, on a system thread.
            format!("{FILTER}:close file {id}"),
            format!("{FUNCTION}:close file {id} in process false"),
        ]
    );
    assert_eq!(pending.completion().unwrap().status, CANCELLED);
    assert_eq!(process.space().locked_pages(), 0, "unlocked at cleanup");
    assert_eq!(w.pnp.open_handle_count(w.device), 0);
    assert_eq!(w.pnp.file_object_count(w.device), 0);
    assert_eq!(w.pnp.exit_process(&process), 0);
    w.pnp.query_and_remove(w.device).unwrap();
    w.verifier.assert_clean();
}

#[test]
fn close_waits_for_the_last_request_on_the_file() {
    let w = world(Breakage::None);
    let process = Process::new(32);
    let handle = w.pnp.open_file(&process, w.device).unwrap();
    let file = handle.file().clone();
    // Asleep: a request sent now waits in the power-managed queue, holding
    // its reference on the file object.
    w.pnp.set_system_power(SystemPowerState::S3).unwrap();
    let late = handle.send(0x0022_2FFC, vec![], 0);
    handle.close();
    assert!(file.is_cleaned_up());
    assert!(!file.is_closed(), "a request still references the file");
    assert_eq!(w.pnp.open_handle_count(w.device), 0);
    assert_eq!(w.pnp.file_object_count(w.device), 1);
    // On resume the request is delivered and completed: CLOSE follows.
    w.pnp.set_system_power(SystemPowerState::S0).unwrap();
    assert!(late.is_done());
    assert!(file.is_closed());
    assert_eq!(w.pnp.file_object_count(w.device), 0);
    w.pnp.exit_process(&process);
    w.verifier.assert_clean();
}

#[test]
fn process_exit_cancels_pending_requests_before_cleanup_and_closes_its_handles() {
    let w = world(Breakage::None);
    let process = Process::new(33);
    let handle = w.pnp.open_file(&process, w.device).unwrap();
    let id = handle.file().id();
    let va = process.alloc(4096).unwrap();
    handle.send(IOCTL_LOCK, lock_request(va), 0);
    let pending = handle.send(IOCTL_HOLD, vec![], 0);
    taken(&w.log);
    // The process leaks its handle and exits.
    drop(handle);
    assert_eq!(w.pnp.exit_process(&process), 0);
    assert_eq!(
        taken(&w.log),
        [
            format!("{FILTER}:cleanup file {id}"),
            format!("{FUNCTION}:cleanup file {id} in process true"),
            // Cancelled by the exit before CLEANUP came.
            format!("{FUNCTION}:held request canceled true"),
            format!("{FILTER}:close file {id}"),
            format!("{FUNCTION}:close file {id} in process false"),
        ]
    );
    assert_eq!(pending.completion().unwrap().status, CANCELLED);
    assert_eq!(w.pnp.process_handle_count(&process), 0);
    // An exited process opens nothing.
    assert_eq!(
        w.pnp.open_file(&process, w.device).unwrap_err(),
        sim_host::file::PROCESS_IS_TERMINATING
    );
    w.verifier.assert_clean();
}

#[test]
fn locking_a_user_buffer_from_a_dpc_is_caught() {
    let w = world(Breakage::LockFromDpc);
    let process = Process::new(34);
    let handle = w.pnp.open_file(&process, w.device).unwrap();
    let va = process.alloc(4096).unwrap();
    let done = handle.send(IOCTL_LOCK, lock_request(va), 0);
    w.sched.run_until_idle(10).unwrap();
    assert!(done.is_done());
    let v = w.verifier.take();
    assert!(
        v.iter().any(|x| x.driver.as_deref() == Some(FUNCTION)
            && x.kind
                == ViolationKind::UserMemoryOutsideProcessContext {
                    pid: 34,
                    current: None,
                    service: "MmProbeAndLockPages(UserMode)",
                }),
        "{v:?}"
    );
    handle.close();
    w.pnp.exit_process(&process);
}

#[test]
fn a_user_request_held_across_sleep_and_locked_on_resume_is_caught() {
    let w = world(Breakage::None);
    let process = Process::new(35);
    let handle = w.pnp.open_file(&process, w.device).unwrap();
    let va = process.alloc(4096).unwrap();
    w.pnp.set_system_power(SystemPowerState::S3).unwrap();
    // Held by the power-managed queue; the issuing thread goes on.
    let done = handle.send(IOCTL_LOCK, lock_request(va), 0);
    assert!(!done.is_done());
    w.verifier.assert_clean();
    // Delivered on resume from the power manager's thread: the driver
    // locks a user address outside its process.
    w.pnp.set_system_power(SystemPowerState::S0).unwrap();
    assert!(done.is_done());
    let v = w.verifier.take();
    assert!(
        v.iter().any(|x| x.driver.as_deref() == Some(FUNCTION)
            && matches!(
                x.kind,
                ViolationKind::UserMemoryOutsideProcessContext { pid: 35, .. }
            )),
        "{v:?}"
    );
    handle.close();
    w.pnp.exit_process(&process);
}

#[test]
fn a_user_request_locked_in_caller_context_and_held_across_sleep_is_clean() {
    let w = world(Breakage::None);
    let process = Process::new(38);
    let handle = w.pnp.open_file(&process, w.device).unwrap();
    let va = process.alloc(4096).unwrap();
    w.pnp.set_system_power(SystemPowerState::S3).unwrap();
    // EvtIoInCallerContext locks the page in the issuing thread, then the
    // power-managed queue holds the request.
    let done = handle.send(IOCTL_LOCK_IN_CALLER, lock_request(va), 0);
    assert!(!done.is_done());
    assert_eq!(process.space().locked_pages(), 1);
    // Delivered on resume outside the process: the driver uses only the
    // lock from the request's context.
    w.pnp.set_system_power(SystemPowerState::S0).unwrap();
    assert_eq!(done.completion().unwrap().status, SUCCESS);
    w.verifier.assert_clean();
    handle.close();
    assert_eq!(w.pnp.exit_process(&process), 0);
    assert_eq!(process.space().locked_pages(), 0);
    w.verifier.assert_clean();
}

#[test]
fn a_request_held_in_the_queue_at_process_exit_is_cancelled_with_its_context() {
    let w = world(Breakage::None);
    let process = Process::new(39);
    let handle = w.pnp.open_file(&process, w.device).unwrap();
    let va = process.alloc(4096).unwrap();
    w.pnp.set_system_power(SystemPowerState::S3).unwrap();
    let done = handle.send(IOCTL_LOCK_IN_CALLER, lock_request(va), 0);
    assert_eq!(process.space().locked_pages(), 1);
    // The framework completes the held request cancelled; the lock in its
    // context goes with it, before the address space is run down.
    drop(handle);
    assert_eq!(w.pnp.exit_process(&process), 0);
    assert_eq!(done.completion().unwrap().status, CANCELLED);
    w.verifier.assert_clean();
    w.pnp.set_system_power(SystemPowerState::S0).unwrap();
    w.verifier.assert_clean();
}

#[test]
fn pages_still_locked_at_process_exit_are_process_has_locked_pages() {
    let w = world(Breakage::KeepLockedPastCleanup);
    let process = Process::new(36);
    let handle = w.pnp.open_file(&process, w.device).unwrap();
    let va = process.alloc(4096).unwrap();
    handle.send(IOCTL_LOCK, lock_request(va), 0);
    handle.close();
    w.verifier.assert_clean();
    assert_eq!(w.pnp.exit_process(&process), 1);
    let v = w.verifier.take();
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(v[0].driver.as_deref(), Some(FUNCTION));
    assert_eq!(
        v[0].kind,
        ViolationKind::ProcessHasLockedPages { pid: 36, pages: 1 }
    );
    w.kept.lock().unwrap().clear();
    assert_eq!(process.space().locked_pages(), 0);
}

#[test]
fn a_close_made_due_by_a_completion_runs_later_on_a_system_thread() {
    let w = world(Breakage::None);
    w.pnp.set_scheduler(w.sched.handle());
    let process = Process::new(37);
    let handle = w.pnp.open_file(&process, w.device).unwrap();
    let file = handle.file().clone();
    w.pnp.set_system_power(SystemPowerState::S3).unwrap();
    let late = handle.send(0x0022_2FFC, vec![], 0);
    handle.close();
    // The completion on resume drops the last reference: CLOSE is queued
    // as a host task, not run inside the completing driver.
    w.pnp.set_system_power(SystemPowerState::S0).unwrap();
    assert!(late.is_done());
    assert!(file.is_cleaned_up() && !file.is_closed());
    w.sched.run_until_idle(10).unwrap();
    assert!(file.is_closed());
    assert_eq!(w.pnp.file_object_count(w.device), 0);
    w.pnp.exit_process(&process);
    w.verifier.assert_clean();
}

#[test]
fn after_surprise_removal_remove_waits_for_the_last_file_object() {
    let w = world(Breakage::None);
    let process = Process::new(37);
    let handle = w.pnp.open_file(&process, w.device).unwrap();
    w.pnp.surprise_remove(w.device);
    assert_eq!(
        w.pnp.state(w.device),
        Some(sim_host::pnp::PnpState::SurpriseRemoved),
        "no IRP_MN_REMOVE_DEVICE while a handle is open"
    );
    assert!(
        w.pnp.stack_services(w.device).len() > 1,
        "the device objects still exist"
    );
    // The last handle closes: CLEANUP, CLOSE, and then REMOVE.
    handle.close();
    assert_eq!(
        w.pnp.state(w.device),
        Some(sim_host::pnp::PnpState::Removed)
    );
    assert!(
        w.pnp.stack_services(w.device).is_empty(),
        "the hardware is gone: its PDO is deleted too"
    );
    w.verifier.assert_clean();
}
