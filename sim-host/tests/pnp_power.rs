//! The host's PnP and power contracts, shown with small sample drivers: a
//! bus driver (with an upper filter) that reports two children, and a child
//! function driver that takes an interface from its parent's PDO.

use std::any::Any;
use std::sync::{Arc, Mutex};

use driver_platform::{
    ChildBus, ChildDescription, DevicePowerState, Irql, Request, RequestorMode, SystemPowerState,
};
use ib_types::interface::WinGuid;
use ib_types::status::NtStatus;
use sim_host::driver::{
    CANCELLED, DeviceCallbacks, DeviceInit, DriverEntry, Forward, NO_SUCH_DEVICE,
    ProvidedInterface, SUCCESS, StackRole, UNSUCCESSFUL,
};
use sim_host::io_target::{
    DefaultTargetCallbacks, IoTargetCallbacks, IoTargetName, IoTargetState, RemoteIoTarget,
};
use sim_host::pnp::{
    Binder, DeviceFailedAction, DeviceServices, InterfaceEvent, PnpManager, PnpState, StackPlan,
};
use sim_host::request::HostRequest;
use sim_host::sched::Scheduler;
use sim_host::verifier::{Verifier, ViolationKind};

// Heap calls the drivers make above DISPATCH_LEVEL are violations
// (docs/host-model.md, "Heap above DISPATCH_LEVEL").
sim_host::install_driver_heap_check!();

const TEST_INTERFACE: WinGuid = WinGuid::from_u128(0x1111_2222_3333_4444_5555_6666_7777_8888);
const CHILD_CLASS: WinGuid = WinGuid::from_u128(0x9999_0000_1111_2222_3333_4444_5555_6666);
const IOCTL_ECHO: u32 = 0x0022_0004;
const IOCTL_HOLD: u32 = 0x0022_0008;
/// Passed down to the PDO by the child's function driver.
const IOCTL_FORWARD: u32 = 0x0022_000C;

type Log = Arc<Mutex<Vec<String>>>;

fn log(l: &Log, s: impl Into<String>) {
    l.lock().unwrap().push(s.into());
}

struct TestBinder;

impl Binder for TestBinder {
    fn bind(&self, _path: &str, hw: &[String], _compat: &[String]) -> Result<StackPlan, String> {
        match hw.first().map(String::as_str) {
            Some("TEST\\BUS") => Ok(StackPlan {
                function: "samplebus".into(),
                upper_filters: vec!["samplefilter".into()],
                lower_filters: vec![],
                security: None,
            }),
            Some("TEST\\CHILD") => Ok(StackPlan {
                function: "samplechild".into(),
                upper_filters: vec![],
                lower_filters: vec![],
                security: None,
            }),
            other => Err(format!("no INF matches {other:?}")),
        }
    }
}

/// Logs every PnP/power callback as `<name>:<callback>`.
struct Logged {
    name: String,
    log: Log,
    veto_power: bool,
    veto_remove: bool,
}

impl Logged {
    fn new(name: &str, log: &Log) -> Self {
        Self {
            name: name.into(),
            log: log.clone(),
            veto_power: false,
            veto_remove: false,
        }
    }
    fn note(&self, what: &str) {
        // PnP and power callbacks run at PASSIVE_LEVEL (on a system
        // thread), whatever IRQL the event that caused them came from.
        let irql = sim_host::irql::current();
        if irql == Irql::PASSIVE {
            log(&self.log, format!("{}:{what}", self.name));
        } else {
            log(&self.log, format!("{}:{what} at {irql:?}", self.name));
        }
    }
}

impl DeviceCallbacks for Logged {
    fn prepare_hardware(&self) -> NtStatus {
        self.note("prepare");
        SUCCESS
    }
    fn release_hardware(&self) -> NtStatus {
        self.note("release");
        SUCCESS
    }
    fn surprise_removal(&self) {
        self.note("surprise");
    }
    fn d0_entry(&self, _from: DevicePowerState) -> NtStatus {
        self.note("d0_entry");
        SUCCESS
    }
    fn d0_exit(&self, _to: DevicePowerState) -> NtStatus {
        self.note("d0_exit");
        SUCCESS
    }
    fn query_power(&self, _t: SystemPowerState) -> NtStatus {
        if self.veto_power {
            UNSUCCESSFUL
        } else {
            SUCCESS
        }
    }
    fn query_remove(&self) -> NtStatus {
        if self.veto_remove {
            UNSUCCESSFUL
        } else {
            SUCCESS
        }
    }
    fn cancel_remove(&self) {
        self.note("cancel_remove");
    }
    fn power_managed_queue(&self) -> bool {
        false
    }
}

/// The root PDO of the bus device.
struct RootPdo(Log);
impl DeviceCallbacks for RootPdo {
    fn d0_entry(&self, _f: DevicePowerState) -> NtStatus {
        log(&self.0, "root-pdo:d0_entry");
        SUCCESS
    }
    fn d0_exit(&self, _t: DevicePowerState) -> NtStatus {
        log(&self.0, "root-pdo:d0_exit");
        SUCCESS
    }
}

/// The bus driver's FDO: reports two children when it starts.
struct BusFdo {
    inner: Logged,
    services: DeviceServices,
    veto_child_power: bool,
    pdo_answers_above_asked: bool,
    fails_every_start: bool,
}

impl DeviceCallbacks for BusFdo {
    fn prepare_hardware(&self) -> NtStatus {
        self.inner.prepare_hardware()
    }
    fn release_hardware(&self) -> NtStatus {
        self.inner.release_hardware()
    }
    fn surprise_removal(&self) {
        self.inner.surprise_removal()
    }
    fn d0_entry(&self, f: DevicePowerState) -> NtStatus {
        let s = self.inner.d0_entry(f);
        if self.fails_every_start {
            self.services.set_failed(DeviceFailedAction::AttemptRestart);
        }
        for i in 0..2 {
            self.services
                .report_present(ChildDescription {
                    instance_id: format!("child{i}"),
                    hardware_ids: vec!["TEST\\CHILD".into()],
                    compatible_ids: vec![],
                    description: format!("sample child {i}"),
                })
                .unwrap();
        }
        s
    }
    fn d0_exit(&self, t: DevicePowerState) -> NtStatus {
        self.inner.d0_exit(t)
    }
    fn create_child(&self, child: &ChildDescription) -> Option<Arc<dyn DeviceCallbacks>> {
        Some(Arc::new(ChildPdo {
            inner: Logged {
                veto_power: self.veto_child_power,
                ..Logged::new(&format!("pdo-{}", child.instance_id), &self.inner.log)
            },
            answers_above_asked: self.pdo_answers_above_asked,
        }))
    }
    fn power_managed_queue(&self) -> bool {
        true
    }
}

/// A child PDO: answers the test interface.
struct ChildPdo {
    inner: Logged,
    answers_above_asked: bool,
}

impl DeviceCallbacks for ChildPdo {
    fn d0_entry(&self, f: DevicePowerState) -> NtStatus {
        self.inner.d0_entry(f)
    }
    fn d0_exit(&self, t: DevicePowerState) -> NtStatus {
        self.inner.d0_exit(t)
    }
    fn query_power(&self, t: SystemPowerState) -> NtStatus {
        self.inner.query_power(t)
    }
    fn io_request(&self, _lower: &dyn Forward, req: HostRequest) {
        // The PDO answers whatever its function driver passes down.
        req.complete(SUCCESS, 7);
    }
    fn query_interface(&self, guid: &WinGuid, version: u16) -> Option<ProvidedInterface> {
        // It implements 1.0 and 1.1: the closest not above the one asked
        // for (broken: always its newest).
        let answer = match version {
            _ if self.answers_above_asked => 0x0101,
            0x0101.. => 0x0101,
            0x0100 => 0x0100,
            _ => return None,
        };
        (*guid == TEST_INTERFACE).then(|| ProvidedInterface {
            version: answer,
            object: Arc::new(String::from("hello from the PDO")) as Arc<dyn Any + Send + Sync>,
        })
    }
}

/// The child function driver: takes the parent's interface at start, keeps
/// one request pending, echoes others.
struct ChildFdo {
    inner: Logged,
    services: DeviceServices,
    iface: Mutex<Option<sim_host::driver::InterfaceRef>>,
    pending: Mutex<Vec<HostRequest>>,
    /// Broken variants for verifier tests.
    leak_interface: bool,
    drop_requests: bool,
    returns_raised: bool,
    prepare_fails: bool,
    d0_entry_fails: bool,
    queue_power_managed: bool,
}

impl DeviceCallbacks for ChildFdo {
    fn prepare_hardware(&self) -> NtStatus {
        let iface = self
            .services
            .query_interface(&TEST_INTERFACE, 0x0101)
            .expect("the PDO answers");
        assert_eq!(iface.get::<String>().unwrap(), "hello from the PDO");
        *self.iface.lock().unwrap() = Some(iface);
        self.services.register_interface(CHILD_CLASS);
        self.services.set_interface_enabled(CHILD_CLASS, true);
        let status = self.inner.prepare_hardware();
        if self.prepare_fails {
            return UNSUCCESSFUL;
        }
        status
    }
    fn release_hardware(&self) -> NtStatus {
        if let Some(i) = self.iface.lock().unwrap().take() {
            if self.leak_interface {
                drop(i);
            } else {
                i.dereference();
            }
        }
        self.inner.note("release");
        SUCCESS
    }
    fn d0_entry(&self, f: DevicePowerState) -> NtStatus {
        if self.returns_raised {
            // Broken: raised and never lowered.
            let _previous = sim_host::irql::raise(Irql::DISPATCH);
        }
        let status = self.inner.d0_entry(f);
        if self.d0_entry_fails {
            return UNSUCCESSFUL;
        }
        status
    }
    fn d0_exit(&self, t: DevicePowerState) -> NtStatus {
        self.inner.d0_exit(t)
    }
    fn query_remove(&self) -> NtStatus {
        self.inner.query_remove()
    }
    fn power_managed_queue(&self) -> bool {
        self.queue_power_managed
    }
    fn surprise_removal(&self) {
        self.inner.note("surprise");
        for req in self.pending.lock().unwrap().drain(..) {
            req.complete(NO_SUCH_DEVICE, 0);
        }
    }
    fn io_request(&self, lower: &dyn Forward, mut req: HostRequest) {
        if self.drop_requests {
            return; // broken: the request is dropped uncompleted
        }
        match req.ioctl_code() {
            IOCTL_ECHO => {
                let data = req.input().to_vec();
                let n = data.len().min(req.output().len());
                req.output()[..n].copy_from_slice(&data[..n]);
                req.complete(SUCCESS, n as u64);
            }
            IOCTL_HOLD => self.pending.lock().unwrap().push(req),
            IOCTL_FORWARD => lower.forward(req),
            _ => req.complete(NtStatus::from_raw(0xC000_0010), 0),
        }
    }
    fn io_stop(&self, stopped: &sim_host::request::StoppedRequest) {
        // A held request needs no hardware: kept across the power-down
        // (without this, the sleep would wait for it for ever).
        if stopped.ioctl() == IOCTL_HOLD {
            stopped.acknowledge();
        }
    }
}

#[derive(Default, Clone, Copy)]
struct Breakage {
    veto_child_power: bool,
    veto_child_remove: bool,
    leak_interface: bool,
    drop_requests: bool,
    /// The child's D0 entry raises to DISPATCH_LEVEL and returns there.
    child_returns_raised: bool,
    /// The child's prepare-hardware (after taking its PDO's interface) or
    /// D0 entry fails.
    child_prepare_fails: bool,
    child_d0_entry_fails: bool,
    /// The child PDOs answer QUERY_INTERFACE above the version asked.
    pdo_answers_above_asked: bool,
    /// The child's function driver makes its queue not power-managed.
    child_queue_not_power_managed: bool,
    /// The bus driver reports its device failed (AttemptRestart) every
    /// time it enters D0.
    bus_fails_every_start: bool,
}

struct BusDriver {
    log: Log,
    b: Breakage,
    services: Arc<Mutex<Option<DeviceServices>>>,
}
impl DriverEntry for BusDriver {
    fn add_device(
        &self,
        _init: &DeviceInit,
        host: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        *self.services.lock().unwrap() = Some(host.clone());
        Ok(Arc::new(BusFdo {
            inner: Logged::new("bus", &self.log),
            services: host.clone(),
            veto_child_power: self.b.veto_child_power,
            pdo_answers_above_asked: self.b.pdo_answers_above_asked,
            fails_every_start: self.b.bus_fails_every_start,
        }))
    }
}

struct FilterDriver(Log);
impl DriverEntry for FilterDriver {
    fn add_device(
        &self,
        _init: &DeviceInit,
        _host: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        Ok(Arc::new(Logged::new("filter", &self.0)))
    }
}

struct ChildDriver {
    log: Log,
    b: Breakage,
}
impl DriverEntry for ChildDriver {
    fn add_device(
        &self,
        init: &DeviceInit,
        host: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        let name = if init.instance_path.ends_with("child0") {
            "child0"
        } else {
            "child1"
        };
        Ok(Arc::new(ChildFdo {
            inner: Logged {
                veto_remove: self.b.veto_child_remove,
                ..Logged::new(name, &self.log)
            },
            services: host.clone(),
            iface: Mutex::new(None),
            pending: Mutex::new(Vec::new()),
            leak_interface: self.b.leak_interface,
            drop_requests: self.b.drop_requests,
            returns_raised: self.b.child_returns_raised,
            prepare_fails: self.b.child_prepare_fails,
            d0_entry_fails: self.b.child_d0_entry_fails,
            queue_power_managed: !self.b.child_queue_not_power_managed,
        }))
    }
}

struct World {
    /// The bus FDO's services, to report children from outside a callback.
    bus_services: Arc<Mutex<Option<DeviceServices>>>,
    pnp: PnpManager,
    verifier: Verifier,
    log: Log,
    bus: sim_host::pnp::DevNodeId,
}

fn world(b: Breakage) -> World {
    let verifier = Verifier::new();
    let pnp = PnpManager::new(verifier.clone(), Box::new(TestBinder));
    let log: Log = Arc::default();
    let bus_services = Arc::default();
    pnp.register_driver(
        "samplebus",
        Arc::new(BusDriver {
            log: log.clone(),
            b,
            services: Arc::clone(&bus_services),
        }),
    );
    pnp.register_driver("samplefilter", Arc::new(FilterDriver(log.clone())));
    pnp.register_driver(
        "samplechild",
        Arc::new(ChildDriver {
            log: log.clone(),
            b,
        }),
    );
    let bus = pnp.add_device(
        None,
        "ROOT\\BUS\\0000",
        vec!["TEST\\BUS".into()],
        vec![],
        Arc::new(RootPdo(log.clone())),
    );
    World {
        bus_services,
        pnp,
        verifier,
        log,
        bus,
    }
}

fn taken(l: &Log) -> Vec<String> {
    std::mem::take(&mut *l.lock().unwrap())
}

fn position(events: &[String], what: &str) -> usize {
    events
        .iter()
        .position(|e| e == what)
        .unwrap_or_else(|| panic!("{what} missing from {events:?}"))
}

#[test]
fn stacks_are_built_and_started_bottom_up_then_children() {
    let w = world(Breakage::default());
    assert_eq!(w.pnp.state(w.bus), Some(PnpState::Started));
    assert_eq!(
        w.pnp.stack_services(w.bus),
        vec![
            ("pdo".to_owned(), StackRole::Pdo),
            ("samplebus".to_owned(), StackRole::Function),
            ("samplefilter".to_owned(), StackRole::UpperFilter)
        ]
    );
    let children = w.pnp.children(w.bus);
    assert_eq!(children.len(), 2);
    for c in &children {
        assert_eq!(w.pnp.state(*c), Some(PnpState::Started));
        assert_eq!(
            w.pnp.stack_services(*c),
            vec![
                ("samplebus".to_owned(), StackRole::Pdo),
                ("samplechild".to_owned(), StackRole::Function)
            ]
        );
        assert_eq!(
            w.pnp.interface_references(*c),
            1,
            "the child FDO holds its PDO's interface"
        );
    }
    let events = taken(&w.log);
    assert!(position(&events, "bus:prepare") < position(&events, "filter:prepare"));
    assert!(position(&events, "root-pdo:d0_entry") < position(&events, "bus:d0_entry"));
    assert!(position(&events, "bus:d0_entry") < position(&events, "filter:d0_entry"));
    assert!(
        position(&events, "filter:d0_entry") < position(&events, "pdo-child0:d0_entry"),
        "parent before children"
    );
    let arrivals = w.pnp.take_interface_events();
    assert_eq!(
        arrivals
            .iter()
            .filter(|e| matches!(e, InterfaceEvent::Arrival { .. }))
            .count(),
        2
    );
    w.verifier.assert_clean();
}

#[test]
fn sleep_powers_children_down_first_and_resume_parents_first() {
    let w = world(Breakage::default());
    taken(&w.log);
    w.pnp.set_system_power(SystemPowerState::S3).unwrap();
    let down = taken(&w.log);
    assert!(
        position(&down, "child0:d0_exit") < position(&down, "pdo-child0:d0_exit"),
        "top-down in a stack"
    );
    assert!(
        position(&down, "pdo-child1:d0_exit") < position(&down, "filter:d0_exit"),
        "children before parent"
    );
    assert!(
        position(&down, "filter:d0_exit") < position(&down, "bus:d0_exit"),
        "top-down"
    );
    assert!(position(&down, "bus:d0_exit") < position(&down, "root-pdo:d0_exit"));
    assert_eq!(w.pnp.power(w.bus), Some(DevicePowerState::D3));
    w.pnp.set_system_power(SystemPowerState::S0).unwrap();
    let up = taken(&w.log);
    assert!(position(&up, "root-pdo:d0_entry") < position(&up, "bus:d0_entry"));
    assert!(
        position(&up, "filter:d0_entry") < position(&up, "pdo-child0:d0_entry"),
        "parent before children"
    );
    assert!(
        position(&up, "pdo-child0:d0_entry") < position(&up, "child0:d0_entry"),
        "bottom-up"
    );
    w.verifier.assert_clean();
}

#[test]
fn a_veto_stops_the_transition_before_anything_moves() {
    let w = world(Breakage {
        veto_child_power: true,
        ..Breakage::default()
    });
    taken(&w.log);
    let veto = w.pnp.set_system_power(SystemPowerState::S4).unwrap_err();
    assert!(
        veto.instance_path.ends_with("child0") || veto.instance_path.ends_with("child1"),
        "{veto}"
    );
    assert!(taken(&w.log).is_empty(), "no device left D0");
    assert_eq!(w.pnp.power(w.bus), Some(DevicePowerState::D0));
    // Shutdown is not queried: the same driver cannot hold it up.
    w.pnp.set_system_power(SystemPowerState::S5).unwrap();
    assert_eq!(w.pnp.power(w.bus), Some(DevicePowerState::D3));
    w.verifier.assert_clean();
}

#[test]
fn requests_wait_in_power_managed_queues_until_resume() {
    let w = world(Breakage::default());
    let child = w.pnp.children(w.bus)[0];
    w.pnp.set_system_power(SystemPowerState::S3).unwrap();
    let (req, handle) = HostRequest::new(
        &w.verifier,
        IOCTL_ECHO,
        RequestorMode::User,
        b"ping".to_vec(),
        8,
    );
    w.pnp.send_request(child, req);
    assert!(!handle.is_done(), "held while the device is in D3");
    w.pnp.set_system_power(SystemPowerState::S0).unwrap();
    let c = handle.completion().expect("delivered after resume");
    assert_eq!(c.status, SUCCESS);
    assert_eq!(&c.output[..4], b"ping");
    w.verifier.assert_clean();
}

#[test]
fn a_pdos_queue_is_power_managed_by_default() {
    // The function driver's queue is not power-managed (its choice): a
    // request reaches it in D3 and goes down to the PDO, whose queue (by
    // KMDF's default) holds it until the device is back in D0.
    let w = world(Breakage {
        child_queue_not_power_managed: true,
        ..Breakage::default()
    });
    let child = w.pnp.children(w.bus)[0];
    let forward = |w: &World| {
        let (req, handle) =
            HostRequest::new(&w.verifier, IOCTL_FORWARD, RequestorMode::Kernel, vec![], 0);
        w.pnp.send_request(child, req);
        handle
    };
    assert_eq!(
        forward(&w).completion().unwrap().information,
        7,
        "the PDO answers in D0"
    );
    w.pnp.set_system_power(SystemPowerState::S3).unwrap();
    let held = forward(&w);
    assert!(!held.is_done(), "held by the PDO's queue while in D3");
    w.pnp.set_system_power(SystemPowerState::S0).unwrap();
    assert_eq!(held.completion().unwrap().status, SUCCESS);
    w.verifier.assert_clean();
}

#[test]
fn surprise_removal_completes_outstanding_requests() {
    let w = world(Breakage::default());
    let child = w.pnp.children(w.bus)[1];
    let (req, pending) =
        HostRequest::new(&w.verifier, IOCTL_HOLD, RequestorMode::Kernel, vec![], 0);
    w.pnp.send_request(child, req);
    assert!(!pending.is_done());
    w.pnp.set_system_power(SystemPowerState::S3).unwrap();
    let (req, held) = HostRequest::new(&w.verifier, IOCTL_ECHO, RequestorMode::Kernel, vec![1], 1);
    w.pnp.send_request(child, req);
    w.pnp.surprise_remove(w.bus);
    assert_eq!(
        pending.completion().unwrap().status,
        NO_SUCH_DEVICE,
        "the driver completed what it held"
    );
    assert_eq!(
        held.completion().unwrap().status,
        NO_SUCH_DEVICE,
        "the queue completed what it held"
    );
    for c in w.pnp.children(w.bus) {
        assert_eq!(w.pnp.state(c), Some(PnpState::Removed));
    }
    assert_eq!(w.pnp.state(w.bus), Some(PnpState::Removed));
    assert!(
        !w.pnp.driver_loaded("samplechild") && !w.pnp.driver_loaded("samplebus"),
        "drivers unloaded"
    );
    w.verifier.assert_clean();
}

#[test]
fn surprise_removal_follows_kmdfs_sequence_stack_by_stack_children_first() {
    let w = world(Breakage::default());
    taken(&w.log);
    w.pnp.surprise_remove(w.bus);
    let events = taken(&w.log);
    // Each stack: EvtDeviceSurpriseRemoval, then D0 exit, then
    // release-hardware; a child's whole sequence before its parent's.
    for child in ["child0", "child1"] {
        let surprise = position(&events, &format!("{child}:surprise"));
        let exit = position(&events, &format!("{child}:d0_exit"));
        let release = position(&events, &format!("{child}:release"));
        assert!(surprise < exit && exit < release, "{child}: {events:?}");
        assert!(
            release < position(&events, "filter:surprise"),
            "{child} before its parent: {events:?}"
        );
    }
    assert!(position(&events, "filter:surprise") < position(&events, "bus:surprise"));
    assert!(position(&events, "bus:surprise") < position(&events, "filter:d0_exit"));
    assert!(position(&events, "bus:d0_exit") < position(&events, "filter:release"));
    assert!(position(&events, "filter:release") < position(&events, "bus:release"));
    assert_eq!(
        events.iter().filter(|e| e.ends_with(":release")).count(),
        4,
        "release-hardware once per layer that prepared: {events:?}"
    );
    assert_eq!(w.pnp.state(w.bus), Some(PnpState::Removed));
    w.verifier.assert_clean();
}

#[test]
fn a_started_child_its_bus_reports_missing_is_surprise_removed() {
    let w = world(Breakage::default());
    let services = w.bus_services.lock().unwrap().clone().unwrap();
    let child1 = w.pnp.find("ROOT\\BUS\\0000\\child1").unwrap();
    taken(&w.log);
    services.report_missing("child1");
    w.pnp.process_bus_relations();
    let events = taken(&w.log);
    assert_eq!(
        events,
        [
            "child1:surprise",
            "child1:d0_exit",
            "pdo-child1:d0_exit",
            "child1:release"
        ],
        "not quietly removed"
    );
    assert_eq!(w.pnp.state(child1), Some(PnpState::Removed));
    w.verifier.assert_clean();
}

#[test]
fn interface_references_do_not_veto_query_remove_and_one_left_at_removal_leaks() {
    let w = world(Breakage::default());
    let child = w.pnp.children(w.bus)[0];
    // Removing a child PDO's devnode is fine: its FDO dereferences on release.
    w.pnp.query_and_remove(child).unwrap();
    assert_eq!(w.pnp.state(child), Some(PnpState::Removed));
    w.verifier.assert_clean();
    // Someone outside holds a child's interface: references are the
    // consumer's responsibility, so removal goes ahead, and the reference
    // still held when the provider's devnode goes is a leak.
    let w = world(Breakage::default());
    let other = w.pnp.children(w.bus)[1];
    let held = w
        .pnp
        .query_interface(other, &TEST_INTERFACE, 0x0100)
        .unwrap();
    w.pnp.query_and_remove(w.bus).unwrap();
    assert_eq!(w.pnp.state(w.bus), Some(PnpState::Removed));
    let v = w.verifier.take();
    assert!(
        matches!(&v[..], [x] if matches!(&x.kind, ViolationKind::ReferenceLeak { what } if what.contains("child1"))),
        "{v:?}"
    );
    held.dereference();
    // A driver vetoes: those who agreed get cancel-remove.
    let w = world(Breakage {
        veto_child_remove: true,
        ..Breakage::default()
    });
    taken(&w.log);
    assert!(w.pnp.query_and_remove(w.bus).is_err());
    assert_eq!(w.pnp.state(w.bus), Some(PnpState::Started));
}

/// A remote I/O target's callbacks, logged as `<name>:<callback>`.
struct TargetProbe {
    name: &'static str,
    log: Log,
    /// `EvtIoTargetQueryRemove` vetoes.
    veto: bool,
    /// Agrees without `WdfIoTargetCloseForQueryRemove` (broken: its handle
    /// stays open).
    agree_but_keep_open: bool,
    /// `EvtIoTargetRemoveComplete` leaves the target open (the driver
    /// closes it later).
    keep_after_removal: bool,
}

impl TargetProbe {
    fn new(name: &'static str, log: &Log) -> Self {
        Self {
            name,
            log: log.clone(),
            veto: false,
            agree_but_keep_open: false,
            keep_after_removal: false,
        }
    }
    fn note(&self, what: &str) {
        let irql = sim_host::irql::current();
        let context = sim_host::context::current_driver();
        log(
            &self.log,
            format!("{}:{what} ({irql:?}, {context:?})", self.name),
        );
    }
}

impl IoTargetCallbacks for TargetProbe {
    fn query_remove(&self, target: &RemoteIoTarget) -> NtStatus {
        self.note("query_remove");
        if self.veto {
            return UNSUCCESSFUL;
        }
        if !self.agree_but_keep_open {
            target.close_for_query_remove();
        }
        SUCCESS
    }
    fn remove_canceled(&self, target: &RemoteIoTarget) {
        self.note("remove_canceled");
        if target.state() == IoTargetState::ClosedForQueryRemove {
            target.reopen().unwrap();
        }
    }
    fn remove_complete(&self, target: &RemoteIoTarget) {
        self.note("remove_complete");
        if !self.keep_after_removal {
            target.close();
        }
    }
}

fn echo(w: &World, target: &RemoteIoTarget) -> NtStatus {
    let (req, handle) = HostRequest::new(
        &w.verifier,
        IOCTL_ECHO,
        RequestorMode::Kernel,
        b"hi".to_vec(),
        2,
    );
    target.send(req);
    handle.completion().expect("completed at once").status
}

const PASSIVE_IN_BUS: &str = "(PASSIVE_LEVEL, Some(\"samplebus\"))";

#[test]
fn remote_io_targets_hear_query_remove_and_may_veto_it() {
    let w = world(Breakage::default());
    let bus = w.bus_services.lock().unwrap().clone().unwrap();
    let child1 = w.pnp.find("ROOT\\BUS\\0000\\child1").unwrap();
    // The bus driver opens child1 by its interface, and by devnode.
    let agreeing = bus
        .open_io_target(
            IoTargetName::Interface {
                class: CHILD_CLASS,
                device: child1,
            },
            Arc::new(TargetProbe::new("agrees", &w.log)),
        )
        .unwrap();
    let vetoing = bus
        .open_io_target(
            IoTargetName::DevNode(child1),
            Arc::new(TargetProbe {
                veto: true,
                ..TargetProbe::new("vetoes", &w.log)
            }),
        )
        .unwrap();
    assert_eq!(echo(&w, &agreeing), SUCCESS, "requests go through");
    assert_eq!(
        bus.open_io_target(
            IoTargetName::Interface {
                class: TEST_INTERFACE,
                device: child1,
            },
            Arc::new(DefaultTargetCallbacks),
        )
        .unwrap_err(),
        sim_host::io_target::OBJECT_NAME_NOT_FOUND,
        "no such interface enabled"
    );
    taken(&w.log);
    let veto = w.pnp.query_and_remove(child1).unwrap_err();
    assert!(veto.service.contains("samplebus"), "{veto}");
    assert_eq!(
        taken(&w.log),
        [
            format!("agrees:query_remove {PASSIVE_IN_BUS}"),
            format!("vetoes:query_remove {PASSIVE_IN_BUS}"),
            format!("agrees:remove_canceled {PASSIVE_IN_BUS}"),
            format!("vetoes:remove_canceled {PASSIVE_IN_BUS}"),
        ],
        "the driver never saw IRP_MN_QUERY_REMOVE_DEVICE; everyone notified hears the cancel"
    );
    assert_eq!(agreeing.state(), IoTargetState::Opened, "reopened");
    assert_eq!(w.pnp.state(child1), Some(PnpState::Started));
    // The vetoing target closes: the next query-remove goes through, and
    // the target that agreed hears that the removal completed.
    vetoing.close();
    assert_eq!(
        echo(&w, &vetoing),
        sim_host::io_target::INVALID_DEVICE_STATE
    );
    w.pnp.query_and_remove(child1).unwrap();
    assert_eq!(w.pnp.state(child1), Some(PnpState::Removed));
    let events: Vec<String> = taken(&w.log)
        .into_iter()
        .filter(|e| e.starts_with("agrees:"))
        .collect();
    assert_eq!(
        events,
        [
            format!("agrees:query_remove {PASSIVE_IN_BUS}"),
            format!("agrees:remove_complete {PASSIVE_IN_BUS}"),
        ]
    );
    assert_eq!(agreeing.state(), IoTargetState::Closed);
    w.verifier.assert_clean();
}

#[test]
fn a_handle_left_open_fails_query_remove() {
    // Broken: agrees to the removal but never closes its target.
    let w = world(Breakage::default());
    let bus = w.bus_services.lock().unwrap().clone().unwrap();
    let child0 = w.pnp.find("ROOT\\BUS\\0000\\child0").unwrap();
    let target = bus
        .open_io_target(
            IoTargetName::DevNode(child0),
            Arc::new(TargetProbe {
                agree_but_keep_open: true,
                ..TargetProbe::new("keeps", &w.log)
            }),
        )
        .unwrap();
    taken(&w.log);
    let veto = w.pnp.query_and_remove(w.bus).unwrap_err();
    assert!(veto.service.contains("1 open handle"), "{veto}");
    assert!(veto.instance_path.ends_with("child0"), "{veto}");
    let events = taken(&w.log);
    assert!(
        events.contains(&format!("keeps:remove_canceled {PASSIVE_IN_BUS}")),
        "{events:?}"
    );
    assert_eq!(w.pnp.state(child0), Some(PnpState::Started));
    assert_eq!(echo(&w, &target), SUCCESS, "still open");
    // A surprise removal cannot be refused: the target hears that the
    // removal completed and closes, and everything goes.
    w.pnp.surprise_remove(w.bus);
    assert_eq!(target.state(), IoTargetState::Closed);
    assert_eq!(w.pnp.state(w.bus), Some(PnpState::Removed));
    w.verifier.assert_clean();
}

#[test]
fn after_surprise_removal_remove_waits_for_the_last_handle() {
    let w = world(Breakage::default());
    let bus = w.bus_services.lock().unwrap().clone().unwrap();
    let child1 = w.pnp.find("ROOT\\BUS\\0000\\child1").unwrap();
    let target = bus
        .open_io_target(
            IoTargetName::DevNode(child1),
            Arc::new(TargetProbe {
                keep_after_removal: true,
                ..TargetProbe::new("holder", &w.log)
            }),
        )
        .unwrap();
    taken(&w.log);
    bus.report_missing("child1");
    w.pnp.process_bus_relations();
    let events = taken(&w.log);
    assert!(
        position(&events, "child1:release")
            < position(&events, &format!("holder:remove_complete {PASSIVE_IN_BUS}")),
        "{events:?}"
    );
    assert_eq!(
        w.pnp.state(child1),
        Some(PnpState::SurpriseRemoved),
        "no REMOVE while the handle is open"
    );
    assert_eq!(echo(&w, &target), NO_SUCH_DEVICE, "the device is gone");
    let pdo_owner = w.pnp.stack_services(child1);
    assert_eq!(pdo_owner.len(), 2, "the device objects still exist");
    target.close();
    assert_eq!(w.pnp.state(child1), Some(PnpState::Removed));
    assert!(
        w.pnp.stack_services(child1).is_empty(),
        "reported missing: its PDO is deleted too"
    );
    assert!(!w.pnp.children(w.bus).contains(&child1));
    w.pnp.query_and_remove(w.bus).unwrap();
    w.verifier.assert_clean();
}

#[test]
fn a_failed_start_releases_the_hardware_and_removes_the_stack() {
    for (breakage, failing) in [
        (
            Breakage {
                child_prepare_fails: true,
                ..Breakage::default()
            },
            "prepare hardware failed",
        ),
        (
            Breakage {
                child_d0_entry_fails: true,
                ..Breakage::default()
            },
            "D0 entry failed",
        ),
    ] {
        let w = world(breakage);
        let events = taken(&w.log);
        let child0 = w.pnp.find("ROOT\\BUS\\0000\\child0").unwrap();
        match w.pnp.state(child0) {
            Some(PnpState::FailedStart(reason)) => assert!(reason.contains(failing), "{reason}"),
            other => panic!("{other:?}"),
        }
        // Release-hardware follows (the failing layer prepared too): the
        // child gives its PDO's interface back there.
        assert!(
            position(&events, "child0:prepare") < position(&events, "child0:release"),
            "{events:?}"
        );
        assert_eq!(w.pnp.interface_references(child0), 0);
        if breakage.child_d0_entry_fails {
            // The PDO below had entered D0: it leaves again before the
            // hardware is released.
            assert!(
                position(&events, "pdo-child0:d0_exit") < position(&events, "child0:release"),
                "{events:?}"
            );
        }
        // The stack above the PDO is gone, and with it the only devices of
        // the child's driver; the PDO stays with its reason.
        assert_eq!(
            w.pnp.stack_services(child0),
            [("samplebus".to_owned(), StackRole::Pdo)]
        );
        assert!(!w.pnp.driver_loaded("samplechild"));
        let (req, handle) =
            HostRequest::new(&w.verifier, IOCTL_ECHO, RequestorMode::Kernel, vec![], 0);
        w.pnp.send_request(child0, req);
        assert_eq!(
            handle.completion().unwrap().status,
            sim_host::driver::DELETE_PENDING
        );
        w.pnp.query_and_remove(w.bus).unwrap();
        assert!(!w.pnp.driver_loaded("samplebus"));
        w.verifier.assert_clean();
    }
}

#[test]
fn a_device_its_driver_sets_failed_takes_the_surprise_removal_path_and_restarts() {
    let w = world(Breakage::default());
    let bus = w.bus_services.lock().unwrap().clone().unwrap();
    let old_children = w.pnp.children(w.bus);
    taken(&w.log);
    {
        // From the bus driver's DPC (WdfDeviceSetFailed is DISPATCH_LEVEL).
        let _dpc = sim_host::irql::IrqlGuard::at(Irql::DISPATCH);
        let _driver = sim_host::context::enter(sim_host::context::Context::driver(
            w.verifier.clone(),
            "samplebus",
        ));
        bus.set_failed(DeviceFailedAction::AttemptRestart);
    }
    assert!(
        taken(&w.log).is_empty(),
        "the PnP manager acts on its worker"
    );
    w.pnp.process_bus_relations();
    let events = taken(&w.log);
    // The children are surprise-removed first, then the failed stack goes
    // through KMDF's sequence...
    assert!(
        position(&events, "child1:release") < position(&events, "filter:surprise"),
        "{events:?}"
    );
    assert!(position(&events, "bus:surprise") < position(&events, "filter:d0_exit"));
    assert!(position(&events, "root-pdo:d0_exit") < position(&events, "bus:release"));
    // ...and is built and started again on the same PDO.
    let restarted = position(&events, "bus:release") + 1;
    assert_eq!(
        events[restarted..].first().map(String::as_str),
        Some("bus:prepare"),
        "{events:?}"
    );
    assert_eq!(w.pnp.state(w.bus), Some(PnpState::Started));
    for old in old_children {
        assert_eq!(w.pnp.state(old), Some(PnpState::Removed));
    }
    let new_children: Vec<_> = w
        .pnp
        .children(w.bus)
        .into_iter()
        .filter(|&c| w.pnp.state(c) == Some(PnpState::Started))
        .collect();
    assert_eq!(new_children.len(), 2, "re-enumerated");
    w.verifier.assert_clean();

    // NoRestart: the stack above the PDO goes and stays gone, and so do the
    // drivers that had no other device.
    let bus = w.bus_services.lock().unwrap().clone().unwrap();
    bus.set_failed(DeviceFailedAction::NoRestart);
    w.pnp.process_bus_relations();
    assert!(
        matches!(w.pnp.state(w.bus), Some(PnpState::Failed(reason)) if reason.contains("samplebus")),
        "{:?}",
        w.pnp.state(w.bus)
    );
    assert_eq!(
        w.pnp.stack_services(w.bus),
        [("pdo".to_owned(), StackRole::Pdo)]
    );
    assert!(!w.pnp.driver_loaded("samplebus") && !w.pnp.driver_loaded("samplechild"));
    w.verifier.assert_clean();

    // Broken: WdfDeviceSetFailed from an ISR.
    let w = world(Breakage::default());
    let bus = w.bus_services.lock().unwrap().clone().unwrap();
    {
        let _isr = sim_host::irql::IrqlGuard::at(sim_host::pci::HCA_DIRQL);
        let _driver = sim_host::context::enter(sim_host::context::Context::driver(
            w.verifier.clone(),
            "samplebus",
        ));
        bus.set_failed(DeviceFailedAction::NoRestart);
    }
    let v = w.verifier.take();
    assert!(
        matches!(&v[..], [x] if x.driver.as_deref() == Some("samplebus")
            && matches!(x.kind, ViolationKind::IrqlTooHigh { service: "WdfDeviceSetFailed", .. })),
        "{v:?}"
    );
}

#[test]
fn a_device_that_fails_after_every_restart_is_given_up_on() {
    let w = world(Breakage {
        bus_fails_every_start: true,
        ..Breakage::default()
    });
    let events = taken(&w.log);
    let starts = events.iter().filter(|e| *e == "bus:prepare").count();
    assert_eq!(
        starts,
        1 + sim_host::pnp::MAX_RESTARTS_AFTER_FAILURE as usize,
        "{events:?}"
    );
    assert!(
        matches!(w.pnp.state(w.bus), Some(PnpState::Failed(_))),
        "{:?}",
        w.pnp.state(w.bus)
    );
    assert!(!w.pnp.driver_loaded("samplebus"));
    w.verifier.assert_clean();
}

#[test]
fn an_unresolvable_binding_fails_to_start_with_the_reason() {
    let verifier = Verifier::new();
    let pnp = PnpManager::new(verifier.clone(), Box::new(TestBinder));
    let node = pnp.add_device(
        None,
        "ROOT\\UNKNOWN\\0",
        vec!["TEST\\NOBODY".into()],
        vec![],
        Arc::new(RootPdo(Arc::default())),
    );
    match pnp.state(node) {
        Some(PnpState::FailedStart(reason)) => {
            assert!(reason.contains("no INF matches"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    // A binding to a service nobody registered.
    let pnp = PnpManager::new(verifier, Box::new(TestBinder));
    let node = pnp.add_device(
        None,
        "ROOT\\BUS\\1",
        vec!["TEST\\BUS".into()],
        vec![],
        Arc::new(RootPdo(Arc::default())),
    );
    assert!(matches!(pnp.state(node), Some(PnpState::FailedStart(r)) if r.contains("samplebus")));
}

#[test]
fn the_verifier_catches_broken_drivers() {
    // A driver that drops a request without completing it.
    let w = world(Breakage {
        drop_requests: true,
        ..Breakage::default()
    });
    let child = w.pnp.children(w.bus)[0];
    let (req, handle) = HostRequest::new(&w.verifier, IOCTL_ECHO, RequestorMode::User, vec![], 0);
    w.pnp.send_request(child, req);
    assert!(handle.was_abandoned());
    let v = w.verifier.take();
    assert!(
        matches!(&v[..], [x] if x.kind == ViolationKind::RequestNotCompleted { ioctl: IOCTL_ECHO } && x.driver.as_deref() == Some("samplechild")),
        "{v:?}"
    );
    // A consumer that drops an interface without dereferencing it.
    let w = world(Breakage {
        leak_interface: true,
        ..Breakage::default()
    });
    w.pnp.surprise_remove(w.bus);
    let v = w.verifier.take();
    assert!(
        v.iter()
            .any(|x| matches!(x.kind, ViolationKind::ReferenceLeak { .. })),
        "{v:?}"
    );
    // A driver unloaded while someone holds a reference on it.
    let w = world(Breakage::default());
    w.pnp
        .driver_references("samplechild")
        .unwrap()
        .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    w.pnp.query_and_remove(w.bus).unwrap();
    let v = w.verifier.take();
    assert!(
        v.iter().any(|x| matches!(
            x.kind,
            ViolationKind::UnloadWhileReferenced { references: 1 }
        )),
        "{v:?}"
    );
}

#[test]
fn deferred_work_outliving_its_driver_is_caught() {
    let w = world(Breakage::default());
    let sched = Scheduler::deterministic(7, w.verifier.clone());
    // The child driver leaves a DPC queued and unloads with its device.
    let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = ran.clone();
    sched.queue_dpc("samplechild", move || {
        flag.store(true, std::sync::atomic::Ordering::SeqCst)
    });
    w.pnp.query_and_remove(w.bus).unwrap();
    assert!(!w.pnp.driver_loaded("samplechild"));
    sched.run_until_idle(10).unwrap();
    assert!(
        !ran.load(std::sync::atomic::Ordering::SeqCst),
        "the unloaded driver's code must not run"
    );
    let v = w.verifier.take();
    assert!(
        matches!(&v[..], [x] if matches!(x.kind, ViolationKind::CallbackIntoUnloadedDriver { .. })
            && x.driver.as_deref() == Some("samplechild")),
        "{v:?}"
    );
}

#[test]
fn completing_another_drivers_request_is_caught() {
    let w = world(Breakage::default());
    let sched = Scheduler::deterministic(3, w.verifier.clone());
    let (mut req, handle) =
        HostRequest::new(&w.verifier, IOCTL_ECHO, RequestorMode::User, vec![], 0);
    // Delivered to the child driver, then completed from the bus driver's DPC.
    req.set_owner(Some("samplechild".into()));
    sched.queue_dpc("samplebus", move || req.complete(SUCCESS, 0));
    sched.run_until_idle(10).unwrap();
    assert_eq!(handle.completion().unwrap().status, SUCCESS);
    let v = w.verifier.take();
    assert!(
        matches!(&v[..], [x] if x.driver.as_deref() == Some("samplebus")
            && matches!(&x.kind, ViolationKind::RequestCompletedByNonOwner { by, .. } if by == "samplebus")),
        "{v:?}"
    );
}

#[test]
fn bus_relations_remove_and_re_add_children() {
    let w = world(Breakage::default());
    let services = w.bus_services.lock().unwrap().clone().unwrap();
    let child0 = w.pnp.find("ROOT\\BUS\\0000\\child0").unwrap();
    let child1 = w.pnp.find("ROOT\\BUS\\0000\\child1").unwrap();
    w.pnp.take_interface_events();
    // The bus notices a child gone (from its DPC, say) and reports it.
    services.report_missing("child1");
    assert_eq!(w.pnp.state(child1), Some(PnpState::Started), "asynchronous");
    w.pnp.process_bus_relations();
    assert_eq!(w.pnp.state(child1), Some(PnpState::Removed));
    assert!(
        w.pnp.driver_loaded("samplechild"),
        "child0 still uses the driver"
    );
    assert!(matches!(&w.pnp.take_interface_events()[..],
            [InterfaceEvent::Removal { device, class }] if *device == child1 && *class == CHILD_CLASS));
    // It comes back: a new devnode, started.
    services
        .report_present(ChildDescription {
            instance_id: "child1".into(),
            hardware_ids: vec!["TEST\\CHILD".into()],
            compatible_ids: vec![],
            description: "sample child 1".into(),
        })
        .unwrap();
    w.pnp.process_bus_relations();
    let again = w.pnp.find("ROOT\\BUS\\0000\\child1").unwrap();
    assert_ne!(again, child1);
    assert_eq!(w.pnp.state(again), Some(PnpState::Started));
    assert_eq!(
        w.pnp.children(w.bus),
        [child0, again],
        "the removed devnode is no longer a child"
    );
    assert_eq!(
        w.pnp.state(child1),
        Some(PnpState::Removed),
        "kept for inspection"
    );
    // Re-reporting a present child keeps its devnode.
    services
        .report_present(ChildDescription {
            instance_id: "child0".into(),
            hardware_ids: vec!["TEST\\CHILD".into()],
            compatible_ids: vec![],
            description: "sample child 0".into(),
        })
        .unwrap();
    w.pnp.process_bus_relations();
    assert_eq!(w.pnp.children(w.bus).len(), 2);
    w.pnp.query_and_remove(w.bus).unwrap();
    w.verifier.assert_clean();
}

#[test]
fn rebalance_stops_and_restarts_with_requests_held_meanwhile() {
    let w = world(Breakage::default());
    let child = w.pnp.children(w.bus)[0];
    let stack = w.pnp.stack_services(child);
    w.pnp.stop(child).unwrap();
    assert_eq!(w.pnp.state(child), Some(PnpState::Stopped));
    assert_eq!(w.pnp.power(child), Some(DevicePowerState::D3));
    let (req, handle) = HostRequest::new(
        &w.verifier,
        IOCTL_ECHO,
        RequestorMode::Kernel,
        b"hi".to_vec(),
        2,
    );
    w.pnp.send_request(child, req);
    assert!(!handle.is_done(), "held while stopped");
    w.pnp.restart(child);
    assert_eq!(w.pnp.state(child), Some(PnpState::Started));
    assert_eq!(
        w.pnp.stack_services(child),
        stack,
        "the same stack, restarted"
    );
    assert_eq!(handle.completion().unwrap().status, SUCCESS);
    w.pnp.query_and_remove(w.bus).unwrap();
    w.verifier.assert_clean();
}

#[test]
fn cancellation_reaches_the_owner() {
    let w = world(Breakage::default());
    let child = w.pnp.children(w.bus)[0];
    let (req, handle) = HostRequest::new(&w.verifier, IOCTL_HOLD, RequestorMode::User, vec![], 0);
    w.pnp.send_request(child, req);
    handle.cancel();
    // The owner notices on its next look and completes with CANCELLED.
    w.pnp.surprise_remove(w.bus);
    let status = handle.completion().unwrap().status;
    assert!(status == NO_SUCH_DEVICE || status == CANCELLED);
    w.verifier.assert_clean();
}

#[test]
fn pnp_callbacks_run_at_passive_even_when_the_event_comes_from_a_dpc() {
    let w = world(Breakage::default());
    taken(&w.log);
    let bus = w.bus_services.lock().unwrap().clone().unwrap();
    {
        // The bus driver reports a child missing from its DPC
        // (IoInvalidateDeviceRelations is callable at DISPATCH_LEVEL), and
        // the PnP manager is even driven from a thread at DISPATCH_LEVEL:
        // the child's removal callbacks still run at PASSIVE_LEVEL.
        let _dpc = sim_host::irql::IrqlGuard::at(Irql::DISPATCH);
        bus.report_missing("child0");
        w.pnp.process_bus_relations();
        assert_eq!(sim_host::irql::current(), Irql::DISPATCH);
    }
    let events = taken(&w.log);
    assert!(events.contains(&"child0:d0_exit".to_owned()), "{events:?}");
    assert!(
        events.iter().all(|e| !e.contains(" at ")),
        "a callback ran above PASSIVE_LEVEL: {events:?}"
    );
    w.verifier.assert_clean();
}

#[test]
fn a_pnp_callback_returning_at_another_irql_is_caught() {
    let w = world(Breakage {
        child_returns_raised: true,
        ..Breakage::default()
    });
    let v = w.verifier.take();
    // Both children's D0 entry returned at DISPATCH_LEVEL; nothing after
    // them runs raised.
    assert_eq!(v.len(), 2, "{v:?}");
    assert!(
        v.iter().all(|x| x.driver.as_deref() == Some("samplechild")
            && matches!(&x.kind, ViolationKind::IrqlMismatch { detail } if detail.contains("EvtDeviceD0Entry"))),
        "{v:?}"
    );
    assert_eq!(sim_host::irql::current(), Irql::PASSIVE);
    let raised: Vec<String> = taken(&w.log)
        .into_iter()
        .filter(|e| e.contains(" at "))
        .collect();
    assert_eq!(
        raised,
        [
            "child0:d0_entry at DISPATCH_LEVEL",
            "child1:d0_entry at DISPATCH_LEVEL"
        ],
        "only the broken callbacks themselves ran raised: the next one starts at PASSIVE_LEVEL"
    );
}

#[test]
fn query_interface_answers_the_closest_version_not_above_the_one_asked() {
    let w = world(Breakage::default());
    let child = w.pnp.children(w.bus)[0];
    for (asked, answered) in [(0x0100, 0x0100), (0x0101, 0x0101), (0x0105, 0x0101)] {
        let iface = w
            .pnp
            .query_interface(child, &TEST_INTERFACE, asked)
            .unwrap_or_else(|| {
                panic!("asked {asked:#x}: an answer at a lower version is an answer")
            });
        assert_eq!(iface.version(), answered, "asked {asked:#x}");
        iface.dereference();
    }
    assert!(
        w.pnp
            .query_interface(child, &TEST_INTERFACE, 0x00FF)
            .is_none(),
        "nothing that low"
    );
    w.verifier.assert_clean();
    // Broken: a provider answering above the version asked for.
    let w = world(Breakage {
        pdo_answers_above_asked: true,
        ..Breakage::default()
    });
    let child = w.pnp.children(w.bus)[0];
    assert!(
        w.pnp
            .query_interface(child, &TEST_INTERFACE, 0x0100)
            .is_none(),
        "an answer above the version asked is no answer"
    );
    let v = w.verifier.take();
    assert_eq!(v.len(), 1, "{v:?}");
    assert!(
        v.iter().all(|x| x.driver.as_deref() == Some("samplebus")
            && matches!(&x.kind, ViolationKind::Protocol { detail } if detail.contains("above the 0x0100 asked"))),
        "{v:?}"
    );
}

#[test]
fn query_interface_above_passive_is_caught() {
    let w = world(Breakage::default());
    let child = w.pnp.children(w.bus)[0];
    let iface = {
        let _dpc = sim_host::irql::IrqlGuard::at(Irql::DISPATCH);
        let _context = sim_host::context::enter(sim_host::context::Context::driver(
            w.verifier.clone(),
            "samplebus",
        ));
        w.pnp.query_interface(child, &TEST_INTERFACE, 0x0100)
    };
    let v = w.verifier.take();
    assert!(
        matches!(&v[..], [x] if x.driver.as_deref() == Some("samplebus")
            && x.kind == ViolationKind::IrqlTooHigh { service: "IRP_MN_QUERY_INTERFACE", at: 2, max: 0 }),
        "{v:?}"
    );
    // Recorded, and still answered: the violation is the failure.
    iface.expect("answered").dereference();
    w.verifier.assert_clean();
}

#[test]
fn a_child_reported_missing_and_removed_is_gone_from_the_tree() {
    // Windows: a PDO its bus no longer reports is deleted after
    // IRP_MN_REMOVE_DEVICE ("Removing a Device in a Bus Driver", step 5):
    // no IRP reaches its stack and it is no longer a child in the tree.
    let w = world(Breakage::default());
    let services = w.bus_services.lock().unwrap().clone().unwrap();
    let child1 = w.pnp.find("ROOT\\BUS\\0000\\child1").unwrap();
    let child0 = w.pnp.find("ROOT\\BUS\\0000\\child0").unwrap();
    services.report_missing("child1");
    w.pnp.process_bus_relations();
    assert_eq!(w.pnp.state(child1), Some(PnpState::Removed));
    assert_eq!(w.pnp.children(w.bus), [child0], "no longer a child");
    assert!(!w.pnp.preorder().contains(&child1), "not in the tree");
    assert!(
        w.pnp.stack_services(child1).is_empty(),
        "its PDO is deleted too"
    );
    assert!(
        w.pnp
            .query_interface(child1, &TEST_INTERFACE, 0x0101)
            .is_none(),
        "QUERY_INTERFACE reaches no device object"
    );
    let (req, handle) = HostRequest::new(&w.verifier, IOCTL_ECHO, RequestorMode::Kernel, vec![], 0);
    w.pnp.send_request(child1, req);
    assert_eq!(handle.completion().unwrap().status, NO_SUCH_DEVICE);
    w.pnp.query_and_remove(w.bus).unwrap();
    w.verifier.assert_clean();
}
