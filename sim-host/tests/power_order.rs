//! The order of device power IRPs at a system transition
//! (docs/host-model.md "Power order between unrelated devnodes"): the tree
//! orders a parent and its children, nothing orders unrelated branches.
//! A sample "device" bus with a child and a root-enumerated sample user
//! of that child (a root device with no tie to the bus) show that every
//! order the host takes keeps the tree's rule, that the seeded order takes
//! both sides of the unrelated pair, and that a driver relying on the
//! accidental enumeration order (the user powered down before the device
//! it uses) is caught by it.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use driver_platform::{ChildBus, ChildDescription, DevicePowerState, SystemPowerState};
use ib_types::status::NtStatus;
use sim_host::driver::{DeviceCallbacks, DeviceInit, DriverEntry, SUCCESS, UNSUCCESSFUL};
use sim_host::pnp::{Binder, DevNodeId, DeviceServices, PnpManager, StackPlan};
use sim_host::power::PowerOrder;
use sim_host::verifier::{Verifier, ViolationKind};

type Log = Arc<Mutex<Vec<String>>>;

struct TestBinder;

impl Binder for TestBinder {
    fn bind(&self, _path: &str, hw: &[String], _compat: &[String]) -> Result<StackPlan, String> {
        let function = match hw.first().map(String::as_str) {
            Some("TEST\\BUS") => "orderbus",
            Some("TEST\\DEVICE") => "orderdevice",
            Some("ROOT\\USER") => "orderuser",
            other => return Err(format!("no INF matches {other:?}")),
        };
        Ok(StackPlan {
            function: function.into(),
            upper_filters: vec![],
            lower_filters: vec![],
            security: None,
        })
    }
}

/// Logs D0 exits and entries of its devnode as `name:exit` / `name:entry`.
struct Logged {
    name: String,
    log: Log,
}

impl DeviceCallbacks for Logged {
    fn d0_exit(&self, _to: DevicePowerState) -> NtStatus {
        self.log.lock().unwrap().push(format!("{}:exit", self.name));
        SUCCESS
    }
    fn d0_entry(&self, _from: DevicePowerState) -> NtStatus {
        self.log
            .lock()
            .unwrap()
            .push(format!("{}:entry", self.name));
        SUCCESS
    }
}

/// Function driver of the bus: reports one child, `device`.
struct BusDriver(Log);

struct Bus {
    host: DeviceServices,
    logged: Logged,
}

impl DeviceCallbacks for Bus {
    fn self_managed_io_init(&self) {
        let _ = self.host.report_present(ChildDescription {
            instance_id: "0".into(),
            hardware_ids: vec!["TEST\\DEVICE".into()],
            compatible_ids: vec![],
            description: "device".into(),
        });
    }
    fn d0_exit(&self, to: DevicePowerState) -> NtStatus {
        self.logged.d0_exit(to)
    }
    fn d0_entry(&self, from: DevicePowerState) -> NtStatus {
        self.logged.d0_entry(from)
    }
    fn create_child(&self, _child: &ChildDescription) -> Option<Arc<dyn DeviceCallbacks>> {
        Some(Arc::new(Logged {
            name: "pdo".into(),
            log: self.logged.log.clone(),
        }))
    }
}

impl DriverEntry for BusDriver {
    fn add_device(
        &self,
        _init: &DeviceInit,
        host: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        Ok(Arc::new(Bus {
            host: host.clone(),
            logged: Logged {
                name: "bus".into(),
                log: self.0.clone(),
            },
        }))
    }
}

/// Function driver of the child and of the root-enumerated user.
struct Plain {
    name: &'static str,
    log: Log,
    /// The user's broken D0 exit: it needs `device` still in D0 (it does
    /// its goodbye through it) and fails otherwise.
    needs_in_d0: Option<(PnpManager, Arc<Mutex<Option<DevNodeId>>>)>,
}

struct PlainDevice {
    logged: Logged,
    needs_in_d0: Option<(PnpManager, Arc<Mutex<Option<DevNodeId>>>)>,
}

impl DeviceCallbacks for PlainDevice {
    fn d0_exit(&self, to: DevicePowerState) -> NtStatus {
        self.logged.d0_exit(to);
        if let Some((pnp, device)) = &self.needs_in_d0
            && let Some(device) = *device.lock().unwrap()
            && pnp.power(device) != Some(DevicePowerState::D0)
        {
            return UNSUCCESSFUL;
        }
        SUCCESS
    }
    fn d0_entry(&self, from: DevicePowerState) -> NtStatus {
        self.logged.d0_entry(from)
    }
}

impl DriverEntry for Plain {
    fn add_device(
        &self,
        _init: &DeviceInit,
        _host: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        Ok(Arc::new(PlainDevice {
            logged: Logged {
                name: self.name.into(),
                log: self.log.clone(),
            },
            needs_in_d0: self.needs_in_d0.clone(),
        }))
    }
}

struct RootPdo;
impl DeviceCallbacks for RootPdo {}

struct World {
    pnp: PnpManager,
    verifier: Verifier,
    log: Log,
}

/// The bus and its child enumerated first, the user root device after
/// them; `broken_user` fails its D0 exit unless the child is in D0.
fn world(order: PowerOrder, broken_user: bool) -> World {
    let verifier = Verifier::new();
    let pnp = PnpManager::new(verifier.clone(), Box::new(TestBinder));
    pnp.set_power_order(order);
    let log: Log = Arc::default();
    let device = Arc::new(Mutex::new(None));
    pnp.register_driver("orderbus", Arc::new(BusDriver(log.clone())));
    pnp.register_driver(
        "orderdevice",
        Arc::new(Plain {
            name: "device",
            log: log.clone(),
            needs_in_d0: None,
        }),
    );
    pnp.register_driver(
        "orderuser",
        Arc::new(Plain {
            name: "user",
            log: log.clone(),
            needs_in_d0: broken_user.then(|| (pnp.clone(), device.clone())),
        }),
    );
    let bus = pnp.add_device(
        None,
        "ROOT\\BUS\\0000",
        vec!["TEST\\BUS".into()],
        vec![],
        Arc::new(RootPdo),
    );
    pnp.process_bus_relations();
    *device.lock().unwrap() = pnp.children(bus).first().copied();
    assert!(device.lock().unwrap().is_some(), "the child is enumerated");
    pnp.add_device(
        None,
        "ROOT\\USER\\0000",
        vec!["ROOT\\USER".into()],
        vec![],
        Arc::new(RootPdo),
    );
    log.lock().unwrap().clear();
    World { pnp, verifier, log }
}

impl World {
    fn taken(&self) -> Vec<String> {
        std::mem::take(&mut *self.log.lock().unwrap())
    }

    /// One sleep and resume: the D0 exits, then the D0 entries.
    fn sleep_and_resume(&self) -> (Vec<String>, Vec<String>) {
        self.pnp.set_system_power(SystemPowerState::S3).unwrap();
        let down = self.taken();
        self.pnp.set_system_power(SystemPowerState::S0).unwrap();
        (down, self.taken())
    }
}

fn position(events: &[String], what: &str) -> usize {
    events
        .iter()
        .position(|e| e == what)
        .unwrap_or_else(|| panic!("{what} missing from {events:?}"))
}

#[test]
fn every_seeded_order_keeps_the_tree_and_takes_both_orders_of_unrelated_devnodes() {
    let mut user_before_device = BTreeSet::new();
    for seed in 0..16 {
        let w = world(PowerOrder::Seeded(seed), false);
        // Two transitions per seed: the order is drawn for each.
        for _ in 0..2 {
            let (down, up) = w.sleep_and_resume();
            assert!(
                position(&down, "device:exit") < position(&down, "pdo:exit"),
                "within a stack top-down: {down:?}"
            );
            assert!(
                position(&down, "pdo:exit") < position(&down, "bus:exit"),
                "child before parent: {down:?}"
            );
            assert!(
                position(&up, "bus:entry") < position(&up, "pdo:entry"),
                "parent before child: {up:?}"
            );
            user_before_device
                .insert(position(&down, "user:exit") < position(&down, "device:exit"));
        }
        w.verifier.assert_clean();
    }
    assert_eq!(
        user_before_device.len(),
        2,
        "the unrelated root device goes down before the bus's child under some seeds and \
         after it under others"
    );
}

#[test]
fn the_enumeration_order_powers_the_device_enumerated_last_down_first() {
    let w = world(PowerOrder::Enumeration, false);
    assert_eq!(w.pnp.power_order(), PowerOrder::Enumeration);
    let (down, up) = w.sleep_and_resume();
    assert_eq!(down, ["user:exit", "device:exit", "pdo:exit", "bus:exit"]);
    assert_eq!(up, ["bus:entry", "pdo:entry", "device:entry", "user:entry"]);
    w.verifier.assert_clean();
}

#[test]
fn earliest_root_first_powers_the_bus_subtree_down_before_a_later_root_device() {
    let w = world(PowerOrder::EarliestRootFirst, false);
    let (down, up) = w.sleep_and_resume();
    assert_eq!(down, ["device:exit", "pdo:exit", "bus:exit", "user:exit"]);
    assert_eq!(up, ["user:entry", "bus:entry", "pdo:entry", "device:entry"]);
    w.verifier.assert_clean();
}

/// The broken sample: a root-enumerated user whose D0 exit needs the
/// device it uses still in D0. The enumeration order happens to suit it;
/// a seeded order that powers the device down first fails its D0 exit.
#[test]
fn a_driver_relying_on_the_order_of_unrelated_devnodes_is_caught_by_a_seeded_order() {
    let w = world(PowerOrder::Enumeration, true);
    w.sleep_and_resume();
    w.verifier.assert_clean();

    // The order that powers the device down first, chosen outright.
    let w = world(PowerOrder::EarliestRootFirst, true);
    w.sleep_and_resume();
    assert!(
        w.verifier
            .take()
            .iter()
            .any(|v| v.driver.as_deref() == Some("orderuser")),
        "the user's D0 exit failed"
    );

    let caught = (0..16).any(|seed| {
        let w = world(PowerOrder::Seeded(seed), true);
        w.sleep_and_resume();
        w.verifier.take().iter().any(|v| {
            v.driver.as_deref() == Some("orderuser")
                && matches!(&v.kind, ViolationKind::Protocol { detail } if detail.contains("D0 exit"))
        })
    });
    assert!(
        caught,
        "some valid order powers the device down before its user"
    );
}
