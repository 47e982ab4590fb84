//! EvtIoStop / EvtIoResume of power-managed queues (`docs/host-model.md`,
//! "Power-managed queues: EvtIoStop and EvtIoResume"): when a device leaves
//! D0, every request the driver owns from its power-managed queue gets
//! `EvtIoStop`, and the power transition waits until each is completed or
//! acknowledged; acknowledged ones get `EvtIoResume` on D0 entry, requeued
//! ones are presented again. Shown with a sample function driver that
//! holds the requests it is sent, in one correct variant per way of
//! answering and one broken variant that ignores `EvtIoStop`.

use std::sync::{Arc, Mutex};

use driver_platform::{DevicePowerState, Request, RequestorMode, SystemPowerState};
use ib_types::status::NtStatus;
use sim_host::driver::{DeviceCallbacks, DeviceInit, DriverEntry, Forward, SUCCESS};
use sim_host::pnp::{Binder, DeviceServices, PnpManager, StackPlan};
use sim_host::request::{HostRequest, RequestHandle, StoppedRequest};
use sim_host::sched::Scheduler;
use sim_host::verifier::{Verifier, ViolationKind};

const IOCTL_WAIT: u32 = 0x0022_4000;

/// What the sample does with a request in `EvtIoStop`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OnStop {
    /// Broken: no EvtIoStop (the default), and it holds the request until
    /// someone else completes it.
    Ignores,
    /// `WdfRequestStopAcknowledge(FALSE)`: keeps it; `EvtIoResume` later.
    Keeps,
    /// `WdfRequestStopAcknowledge(TRUE)`: gives it back to be presented
    /// again after D0 entry.
    Requeues,
    /// Completes it now.
    Completes,
    /// Completes it a little later, from a DPC (the transition waits).
    CompletesFromDpc,
    /// Broken: completes it, then acknowledges it.
    CompletesThenAcknowledges,
}

type Log = Arc<Mutex<Vec<String>>>;

struct SampleBinder;

impl Binder for SampleBinder {
    fn bind(&self, _: &str, _: &[String], _: &[String]) -> Result<StackPlan, String> {
        Ok(StackPlan {
            function: "holder".into(),
            upper_filters: vec![],
            lower_filters: vec![],
            security: None,
        })
    }
}

struct Holder {
    on_stop: OnStop,
    log: Log,
    held: Arc<Mutex<Vec<HostRequest>>>,
    sched: sim_host::sched::SchedulerHandle,
}

impl Holder {
    fn note(&self, what: String) {
        self.log.lock().unwrap().push(what);
    }

    fn take(&self, id: sim_host::request::RequestId) -> Option<HostRequest> {
        let mut held = self.held.lock().unwrap();
        let at = held.iter().position(|r| r.id() == id)?;
        Some(held.remove(at))
    }
}

impl DeviceCallbacks for Holder {
    fn d0_exit(&self, _: DevicePowerState) -> NtStatus {
        self.note("d0_exit".into());
        SUCCESS
    }
    fn d0_entry(&self, _: DevicePowerState) -> NtStatus {
        self.note("d0_entry".into());
        SUCCESS
    }
    fn io_request(&self, _: &dyn Forward, req: HostRequest) {
        self.note(format!("request {}", req.id().raw()));
        self.held.lock().unwrap().push(req);
    }
    fn io_stop(&self, stopped: &StoppedRequest) {
        self.note(format!(
            "stop {} {:?}",
            stopped.id().raw(),
            stopped.action()
        ));
        match self.on_stop {
            OnStop::Ignores => {}
            OnStop::Keeps => stopped.acknowledge(),
            OnStop::Requeues => {
                if let Some(req) = self.take(stopped.id()) {
                    stopped.requeue(req);
                }
            }
            OnStop::Completes => {
                if let Some(req) = self.take(stopped.id()) {
                    req.complete(sim_host::driver::CANCELLED, 0);
                }
            }
            OnStop::CompletesThenAcknowledges => {
                if let Some(req) = self.take(stopped.id()) {
                    req.complete(SUCCESS, 0);
                }
                stopped.acknowledge();
            }
            OnStop::CompletesFromDpc => {
                let req = self.take(stopped.id());
                self.sched.queue_dpc("holder", move || {
                    if let Some(req) = req {
                        req.complete(sim_host::driver::CANCELLED, 0);
                    }
                });
            }
        }
    }
    fn io_resume(&self, request: &StoppedRequest) {
        self.note(format!("resume {}", request.id().raw()));
    }
}

struct HolderDriver {
    on_stop: OnStop,
    log: Log,
    held: Arc<Mutex<Vec<HostRequest>>>,
    sched: sim_host::sched::SchedulerHandle,
}

impl DriverEntry for HolderDriver {
    fn add_device(
        &self,
        _: &DeviceInit,
        _: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        Ok(Arc::new(Holder {
            on_stop: self.on_stop,
            log: self.log.clone(),
            held: self.held.clone(),
            sched: self.sched.clone(),
        }))
    }
}

struct Machine {
    pnp: PnpManager,
    verifier: Verifier,
    log: Log,
    /// What the driver holds (the test completes them as "the event").
    held: Arc<Mutex<Vec<HostRequest>>>,
    node: sim_host::pnp::DevNodeId,
    _sched: Scheduler,
}

fn machine(on_stop: OnStop) -> Machine {
    let verifier = Verifier::new();
    let sched = Scheduler::deterministic(7, verifier.clone());
    let pnp = PnpManager::new(verifier.clone(), Box::new(SampleBinder));
    pnp.set_scheduler(sched.handle());
    let (log, held) = (Log::default(), Arc::default());
    pnp.register_driver(
        "holder",
        Arc::new(HolderDriver {
            on_stop,
            log: Arc::clone(&log),
            held: Arc::clone(&held),
            sched: sched.handle(),
        }),
    );
    struct RootPdo;
    impl DeviceCallbacks for RootPdo {}
    let node = pnp.add_device(
        None,
        "ROOT\\HOLDER\\0000",
        vec![],
        vec![],
        Arc::new(RootPdo),
    );
    log.lock().unwrap().clear();
    Machine {
        pnp,
        verifier,
        log,
        held,
        node,
        _sched: sched,
    }
}

impl Machine {
    fn send(&self) -> (u64, RequestHandle) {
        let (req, handle) =
            HostRequest::new(&self.verifier, IOCTL_WAIT, RequestorMode::User, vec![], 0);
        let id = req.id().raw();
        self.pnp.send_request(self.node, req);
        (id, handle)
    }

    fn log(&self) -> Vec<String> {
        std::mem::take(&mut *self.log.lock().unwrap())
    }

    /// The driver completes everything it holds (the event it waited for).
    fn complete_held(&self) {
        for req in self.held.lock().unwrap().drain(..) {
            req.complete(SUCCESS, 0);
        }
    }
}

#[test]
fn a_driver_that_ignores_evt_io_stop_while_holding_a_request_blocks_the_sleep() {
    let m = machine(OnStop::Ignores);
    let (id, handle) = m.send();
    m.pnp.set_system_power(SystemPowerState::S3).unwrap();
    assert_eq!(
        m.log(),
        [
            format!("request {id}"),
            format!("stop {id} Suspend"),
            "d0_exit".into()
        ]
    );
    let v = m.verifier.take();
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(v[0].driver.as_deref(), Some("holder"));
    assert_eq!(
        v[0].kind,
        ViolationKind::RequestBlocksPowerDown {
            ioctl: IOCTL_WAIT,
            request: id
        }
    );
    // Nothing is lost: the request is still the driver's to complete.
    assert!(!handle.is_done());
    m.pnp.set_system_power(SystemPowerState::S0).unwrap();
    m.complete_held();
    assert_eq!(handle.completion().unwrap().status, SUCCESS);
    m.verifier.assert_clean();
}

#[test]
fn a_request_completed_before_the_sleep_is_not_stopped() {
    let m = machine(OnStop::Ignores);
    let (_, handle) = m.send();
    m.complete_held();
    assert!(handle.is_done());
    m.log();
    m.pnp.set_system_power(SystemPowerState::S3).unwrap();
    assert_eq!(m.log(), ["d0_exit"], "no EvtIoStop for a completed request");
    m.verifier.assert_clean();
}

#[test]
fn an_acknowledged_request_stays_with_the_driver_and_resumes_after_d0_entry() {
    let m = machine(OnStop::Keeps);
    let (id, handle) = m.send();
    m.pnp.set_system_power(SystemPowerState::S3).unwrap();
    m.pnp.set_system_power(SystemPowerState::S0).unwrap();
    assert_eq!(
        m.log(),
        [
            format!("request {id}"),
            format!("stop {id} Suspend"),
            "d0_exit".into(),
            "d0_entry".into(),
            format!("resume {id}"),
        ]
    );
    assert!(!handle.is_done(), "still held by the driver");
    // A second sleep stops it again.
    m.pnp.set_system_power(SystemPowerState::S4).unwrap();
    assert_eq!(m.log(), [format!("stop {id} Suspend"), "d0_exit".into()]);
    m.pnp.set_system_power(SystemPowerState::S0).unwrap();
    m.complete_held();
    assert_eq!(handle.completion().unwrap().status, SUCCESS);
    m.verifier.assert_clean();
}

#[test]
fn a_requeued_request_is_presented_again_after_d0_entry() {
    let m = machine(OnStop::Requeues);
    let (id, handle) = m.send();
    m.pnp.set_system_power(SystemPowerState::S3).unwrap();
    assert!(m.held.lock().unwrap().is_empty(), "given back to the queue");
    m.pnp.set_system_power(SystemPowerState::S0).unwrap();
    assert_eq!(
        m.log(),
        [
            format!("request {id}"),
            format!("stop {id} Suspend"),
            "d0_exit".into(),
            "d0_entry".into(),
            format!("request {id}"),
        ],
        "the same request, presented again; no EvtIoResume for it"
    );
    m.complete_held();
    assert_eq!(handle.completion().unwrap().status, SUCCESS);
    m.verifier.assert_clean();
}

#[test]
fn requests_completed_in_or_after_evt_io_stop_let_the_sleep_finish() {
    for on_stop in [OnStop::Completes, OnStop::CompletesFromDpc] {
        let m = machine(on_stop);
        let handles: Vec<_> = (0..3).map(|_| m.send().1).collect();
        m.pnp.set_system_power(SystemPowerState::S3).unwrap();
        // The transition waited (running the DPC) until all were done.
        for h in &handles {
            assert_eq!(h.completion().unwrap().status, sim_host::driver::CANCELLED);
        }
        let log = m.log();
        assert_eq!(log.last().map(String::as_str), Some("d0_exit"), "{log:?}");
        m.verifier.assert_clean();
    }
}

#[test]
fn removal_purges_and_a_requeued_request_is_completed_by_the_queue() {
    let m = machine(OnStop::Requeues);
    let (id, handle) = m.send();
    m.pnp.query_and_remove(m.node).unwrap();
    assert_eq!(
        m.log(),
        [
            format!("request {id}"),
            format!("stop {id} Purge"),
            "d0_exit".into()
        ]
    );
    assert_eq!(
        handle.completion().unwrap().status,
        sim_host::driver::NO_SUCH_DEVICE
    );
    m.verifier.assert_clean();
}

#[test]
fn acknowledging_a_request_the_driver_completed_is_caught() {
    let m = machine(OnStop::CompletesThenAcknowledges);
    let (id, handle) = m.send();
    m.pnp.set_system_power(SystemPowerState::S3).unwrap();
    assert!(handle.is_done());
    let v = m.verifier.take();
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(v[0].driver.as_deref(), Some("holder"));
    assert!(
        matches!(&v[0].kind, ViolationKind::Protocol { detail }
            if detail.contains("WdfRequestStopAcknowledge") && detail.contains(&format!("request {id} "))),
        "{v:?}"
    );
}
