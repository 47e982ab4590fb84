//! Binding from our own `inf/*.inf` files: the PCI bus reports the HCA,
//! `hca-miniport.inf` puts the miniport and the access-layer bus filter on
//! it and writes the filter's static-child list; the filter reports that
//! child from the registry, and `ib-port-client.inf` binds the child.
//! The drivers are the host's stand-ins (`sim_host::samples`).

use std::sync::Arc;

use driver_platform::{Irql, RegValue, Registry, RegistryKey};
use sim_hca::device::DeviceConfig;
use sim_host::driver::{DeviceCallbacks, StackRole};
use sim_host::host::{Host, HostConfig};
use sim_host::pci::PCI_SERVICE;
use sim_host::pnp::PnpState;
use sim_host::registry::device_instance_key;
use sim_host::samples::{Log, register_stand_ins};
use sim_host::verifier::ViolationKind;

// Heap calls the drivers make above DISPATCH_LEVEL are violations
// (docs/host-model.md, "Heap above DISPATCH_LEVEL").
sim_host::install_driver_heap_check!();

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
    let log = register_stand_ins(&host);
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
    let starts: Vec<String> = log.into_iter().filter(|l| !l.contains(" D0 ")).collect();
    assert_eq!(
        starts,
        vec![
            format!("hcaminiport {hca:?} start"),
            format!(
                "hcaminiport {hca:?} magic {:#x}",
                hca_prm::regs::MAGIC_VALUE
            ),
            format!("ibalbus {hca:?} start"),
            format!("ibalbus {hca:?} child IPoIB pkey Some(ffff)"),
            format!("ibportclient {child:?} start"),
            format!("ibportclient {child:?} receive depth Some(256)"),
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

/// The instance paths of `node` and its started descendants.
fn started_paths(host: &Host, node: sim_host::pnp::DevNodeId) -> Vec<String> {
    let pnp = host.pnp();
    let mut paths = vec![pnp.instance_path(node).unwrap()];
    for child in pnp.children(node) {
        if pnp.state(child) == Some(PnpState::Started) {
            paths.extend(started_paths(host, child));
        }
    }
    paths
}

#[test]
fn a_removed_hca_plugged_in_again_comes_back_with_the_same_instance_paths() {
    let w = world();
    let hca = w.hcas()[0];
    let before = started_paths(&w, hca);
    assert_eq!(before.len(), 2, "the HCA and its child");
    // Plugging in a function that is present changes nothing.
    w.replug_hca(0).unwrap();
    assert_eq!(w.hcas(), [hca]);
    assert_eq!(
        w.replug_hca(7),
        Err(ib_types::status::NtStatus::INVALID_PARAMETER),
        "no such function"
    );

    // Orderly removal, then the slot reports the HCA again: a new devnode
    // with the same instance path, bound and started as at boot, and the
    // same child under it.
    w.pnp().query_and_remove(hca).unwrap();
    assert_eq!(w.pnp().state(hca), Some(PnpState::Removed));
    w.replug_hca(0).unwrap();
    let again = w.hcas()[0];
    assert_ne!(again, hca, "a new devnode");
    assert_eq!(w.pnp().state(again), Some(PnpState::Started));
    assert_eq!(started_paths(&w, again), before);
    assert_eq!(w.pnp().find(&before[0]), Some(again), "found by its path");

    // Surprise removal, then a re-plug: the same again.
    w.pnp().surprise_remove(again);
    assert_eq!(w.pnp().state(again), Some(PnpState::Removed));
    w.replug_hca(0).unwrap();
    let third = w.hcas()[0];
    assert_eq!(w.pnp().state(third), Some(PnpState::Started));
    assert_eq!(started_paths(&w, third), before);
    w.shut_down();
    w.verifier().assert_clean();
}
