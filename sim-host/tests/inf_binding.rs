//! Binding from our own `inf/*.inf` files: the PCI bus reports the HCA,
//! `hca-miniport.inf` puts the miniport and the access-layer bus filter on
//! it and writes the filter's static-child list; the filter reports that
//! child from the registry, and `ib-port-client.inf` binds the child.
//! The drivers here are samples that record what they see.

use std::sync::{Arc, Mutex};

use driver_platform::{ChildBus, ChildDescription, Irql, RegValue, Registry, RegistryKey};
use ib_types::status::NtStatus;
use sim_hca::device::DeviceConfig;
use sim_host::driver::{
    DeviceCallbacks, DeviceInit, DriverEntry, SUCCESS, StackRole, UNSUCCESSFUL,
};
use sim_host::host::{Host, HostConfig};
use sim_host::pci::{PCI_SERVICE, PciFunction};
use sim_host::pnp::{DeviceServices, PnpState};
use sim_host::registry::device_instance_key;
use sim_host::verifier::ViolationKind;

type Log = Arc<Mutex<Vec<String>>>;

struct Sample {
    service: &'static str,
    log: Log,
}

impl DriverEntry for Sample {
    fn add_device(
        &self,
        init: &DeviceInit,
        host: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        Ok(Arc::new(SampleDevice {
            service: self.service,
            role: init.role,
            host: host.clone(),
            log: self.log.clone(),
        }))
    }
}

struct SampleDevice {
    service: &'static str,
    role: StackRole,
    host: DeviceServices,
    log: Log,
}

fn multi(view: &dyn Registry, key: RegistryKey, name: &str) -> Vec<String> {
    match view.read(key, name) {
        Some(RegValue::MultiString(v)) => v,
        Some(RegValue::String(s)) => vec![s],
        _ => Vec::new(),
    }
}

impl DeviceCallbacks for SampleDevice {
    fn prepare_hardware(&self) -> NtStatus {
        self.log
            .lock()
            .unwrap()
            .push(format!("{} start", self.service));
        match self.service {
            "hcaminiport" => {
                // The function driver finds the PCI function's BAR.
                let Some(function) = self.host.resources::<PciFunction>() else {
                    return UNSUCCESSFUL;
                };
                let magic = function.bar0().read32(hca_prm::regs::offset::MAGIC);
                self.log.lock().unwrap().push(format!("magic {magic:#x}"));
            }
            "ibalbus" => {
                // The filter reports the static children its INF listed.
                let Some(view) = self.host.registry() else {
                    return UNSUCCESSFUL;
                };
                for name in multi(&view, RegistryKey::ServiceParameters, "StaticChild") {
                    let hardware_ids = multi(
                        &view,
                        RegistryKey::ServiceParameters,
                        &format!("{name}\\HardwareId"),
                    );
                    let compatible_ids = multi(
                        &view,
                        RegistryKey::ServiceParameters,
                        &format!("{name}\\CompatibleId"),
                    );
                    let pkey = view.read_dword(
                        RegistryKey::ServiceParameters,
                        &format!("{name}\\PartitionKey"),
                    );
                    self.log
                        .lock()
                        .unwrap()
                        .push(format!("child {name} pkey {pkey:#x?}"));
                    let child = ChildDescription {
                        instance_id: name.clone(),
                        hardware_ids,
                        compatible_ids,
                        description: name,
                    };
                    if let Err(s) = self.host.report_present(child) {
                        return s;
                    }
                }
            }
            "ibportclient" => {
                let Some(view) = self.host.registry() else {
                    return UNSUCCESSFUL;
                };
                let depth = view.read_dword(RegistryKey::Device, "ReceiveDepth");
                self.log
                    .lock()
                    .unwrap()
                    .push(format!("receive depth {depth:?}"));
            }
            _ => {}
        }
        SUCCESS
    }

    fn create_child(&self, _child: &ChildDescription) -> Option<Arc<dyn DeviceCallbacks>> {
        (self.service == "ibalbus" && self.role == StackRole::UpperFilter)
            .then(|| Arc::new(ChildPdo) as Arc<dyn DeviceCallbacks>)
    }

    fn power_managed_queue(&self) -> bool {
        self.role == StackRole::Function
    }
}

struct ChildPdo;
impl DeviceCallbacks for ChildPdo {
    fn power_managed_queue(&self) -> bool {
        false
    }
}

struct RootPdo;
impl DeviceCallbacks for RootPdo {}

struct World {
    host: Host,
    log: Log,
}

impl std::ops::Deref for World {
    type Target = Host;
    fn deref(&self) -> &Host {
        &self.host
    }
}

fn world() -> World {
    let cfg = DeviceConfig::with_ports(0x0002_C900_0000_1000, &[[10, 0, 0, 1]]);
    let host = Host::new(HostConfig::deterministic(5, vec![cfg])).unwrap();
    let log: Log = Arc::default();
    for service in ["hcaminiport", "ibalbus", "ibportclient"] {
        host.register_driver(
            service,
            Arc::new(Sample {
                service,
                log: log.clone(),
            }),
        );
    }
    host.boot();
    World { host, log }
}

#[test]
fn the_hca_and_its_port_client_bind_from_our_infs() {
    let w = world();
    let bus = w.pnp().find("ACPI\\PNP0A08\\0").unwrap();
    let hca = w.pnp().children(bus)[0];
    assert_eq!(w.pnp().state(hca), Some(PnpState::Started));
    assert_eq!(
        w.pnp().stack_services(hca),
        vec![
            (PCI_SERVICE.to_owned(), StackRole::Pdo),
            ("hcaminiport".to_owned(), StackRole::Function),
            ("ibalbus".to_owned(), StackRole::UpperFilter),
        ]
    );
    let hca_path = w.pnp().instance_path(hca).unwrap();
    assert_eq!(
        w.registry()
            .get_value(&device_instance_key(&hca_path), "Service"),
        Some(RegValue::String("hcaminiport".into()))
    );
    let children = w.pnp().children(hca);
    assert_eq!(children.len(), 1, "the INF's one static child");
    let child = children[0];
    assert!(w.pnp().instance_path(child).unwrap().ends_with("\\IPoIB"));
    assert_eq!(
        w.pnp().stack_services(child),
        vec![
            ("ibalbus".to_owned(), StackRole::Pdo),
            ("ibportclient".to_owned(), StackRole::Function)
        ]
    );
    let log = w.log.lock().unwrap().clone();
    assert_eq!(
        log,
        vec![
            "hcaminiport start".to_owned(),
            format!("magic {:#x}", hca_prm::regs::MAGIC_VALUE),
            "ibalbus start".to_owned(),
            "child IPoIB pkey Some(\n    0xffff,\n)".to_owned(),
            "ibportclient start".to_owned(),
            "receive depth Some(256)".to_owned(),
        ]
    );
    w.pnp().query_and_remove(bus).unwrap();
    assert!(!w.pnp().driver_loaded("ibalbus") && !w.pnp().driver_loaded("hcaminiport"));
    w.verifier().assert_clean();
}

#[test]
fn a_device_no_inf_matches_fails_to_start_with_the_reason() {
    let w = world();
    let node = w.pnp().add_device(
        None,
        "ROOT\\UNKNOWN\\0000",
        vec!["ROOT\\NOBODY_HOME".into()],
        vec![],
        Arc::new(RootPdo),
    );
    match w.pnp().state(node) {
        Some(PnpState::FailedStart(reason)) => assert!(
            reason.contains("no INF matches") && reason.contains("NOBODY_HOME"),
            "{reason}"
        ),
        other => panic!("{other:?}"),
    }
    w.verifier().assert_clean();
}

#[test]
fn reading_the_registry_from_a_dpc_is_an_irql_violation() {
    let w = world();
    let bus = w.pnp().find("ACPI\\PNP0A08\\0").unwrap();
    let hca = w.pnp().children(bus)[0];
    let view = w
        .registry()
        .view("ibalbus", &w.pnp().instance_path(hca).unwrap());
    w.scheduler().queue_dpc("ibalbus", move || {
        assert_eq!(sim_host::irql::current(), Irql::DISPATCH);
        let _ = view.read(RegistryKey::ServiceParameters, "StaticChild");
    });
    w.scheduler().run_until_idle(100).unwrap();
    let v = w.verifier().take();
    assert!(
        matches!(&v[..], [x] if x.driver.as_deref() == Some("ibalbus")
            && matches!(x.kind, ViolationKind::IrqlTooHigh { service: "ZwQueryValueKey", .. })),
        "{v:?}"
    );
}
