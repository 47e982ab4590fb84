//! Scenario: the real IBAL bus filter (`sim_shells::ibal_bus`) as the
//! upper filter of two HCAs with two ports each, over the real miniport,
//! its port children bound to the `ibportclient` stand-in from
//! `inf/ib-port-client.inf`: children per port from the INF's list, from
//! the default (no list) and from a custom list; entries added and removed
//! at runtime; instance IDs stable across a restart of an HCA stack and a
//! reboot; HCAs leaving in either order; the threaded host; a CI
//! version mismatch failing the filter's start cleanly; a child's DMA
//! adapter being the HCA's own (IOMMU). Every test ends
//! with the host shut down and the verifier report empty.
#![cfg(not(windows))]

mod support;

use std::any::Any;
use std::sync::{Arc, Mutex};

use driver_platform::RegValue;
use driver_platform::{CommonBuffer, DmaAdapter};
use ib_types::interface::{GUID_IB_CI_INTERFACE, InterfaceVersion, WinGuid};
use ib_types::status::NtStatus;
use ibal_bus_core::ca_registry::STATUS_REVISION_MISMATCH;
use ibal_bus_core::children::ChildEntry;
use ibal_bus_core::ci::REQUIRED_CI_VERSION;
use sim_hca::host::HostMemory;
use sim_host::dma::{HostCommonBuffer, HostDmaAdapter};
use sim_host::driver::SUCCESS;
use sim_host::driver::{DeviceCallbacks, DeviceInit, DriverEntry, ProvidedInterface};
use sim_host::host::{Host, HostConfig};
use sim_host::pci::{
    BUS_INTERFACE_STANDARD_VERSION, BusInterfaceStandard, GUID_BUS_INTERFACE_STANDARD,
};
use sim_host::pnp::{DevNodeId, DeviceServices, PnpState};
use sim_host::registry::service_parameters_key;
use sim_host::verifier::ViolationKind;
use sim_shells::ibal_bus::{IbalBusDriver, SERVICE};

use support::{HCAS, finish, hca_configs, register_stack, settle, started_children};

fn host(seed: u64) -> Host {
    let configs = hca_configs();
    Host::new(HostConfig::deterministic(seed, configs)).unwrap()
}

/// Registers the stand-ins (the port client), the real miniport and the
/// real filter.
fn drivers(host: &Host) -> Arc<IbalBusDriver> {
    register_stack(host).0
}

fn params() -> String {
    service_parameters_key(SERVICE)
}

fn add_entry(host: &Host, name: &str, device: &str, pkey: u32) {
    let key = format!("{}\\{name}", params());
    let reg = host.registry();
    reg.create_key(&key).unwrap();
    reg.set_value(&key, "DeviceId", RegValue::String(device.into()))
        .unwrap();
    reg.set_value(
        &key,
        "HardwareId",
        RegValue::MultiString(vec![device.into()]),
    )
    .unwrap();
    reg.set_value(
        &key,
        "CompatibleId",
        RegValue::MultiString(vec!["IBA\\PORT_CLIENT".into()]),
    )
    .unwrap();
    reg.set_value(&key, "PartitionKey", RegValue::Dword(pkey))
        .unwrap();
}

fn set_list(host: &Host, names: &[&str]) {
    host.registry()
        .set_value(
            &params(),
            "StaticChild",
            RegValue::MultiString(names.iter().map(|s| s.to_string()).collect()),
        )
        .unwrap();
}

/// The filter's children of every HCA: (CA GUID, port, entry, instance ID).
fn filter_children(driver: &IbalBusDriver) -> Vec<(u64, u8, String, String)> {
    let mut all: Vec<_> = driver
        .devices()
        .iter()
        .flat_map(|d| d.children())
        .map(|c| {
            (
                c.ca_guid.get(),
                c.port_num.get(),
                c.entry.clone(),
                c.instance_id().to_owned(),
            )
        })
        .collect();
    all.sort();
    all
}

/// Stops and restarts every HCA stack.
fn restart_all(host: &Host) {
    for hca in host.hcas() {
        host.pnp().stop(hca).unwrap();
        settle(host);
        host.pnp().restart(hca);
        settle(host);
    }
}

#[test]
fn two_hcas_with_two_ports_get_one_child_per_port_from_the_inf_list_and_the_default() {
    let host = host(11);
    let driver = drivers(&host);
    host.boot();
    settle(&host);
    for remove_list in [false, true] {
        if remove_list {
            // No list: the IPoIB default, read when the stacks start again.
            host.registry()
                .delete_value(&params(), "StaticChild")
                .unwrap();
            restart_all(&host);
            for device in driver.devices() {
                assert_eq!(device.child_list().entries, [ChildEntry::ipoib()]);
            }
        }
        let mut registered: Vec<u64> = driver.registered_cas().iter().map(|g| g.get()).collect();
        registered.sort();
        assert_eq!(registered, HCAS);
        let children = filter_children(&driver);
        assert_eq!(children.len(), 4, "{children:?}");
        for hca in HCAS {
            let ports: Vec<u8> = children
                .iter()
                .filter(|c| c.0 == hca)
                .map(|c| c.1)
                .collect();
            assert_eq!(ports, [1, 2]);
        }
        assert!(
            children
                .iter()
                .all(|c| c.2 == "IPoIB" && c.3.ends_with("_FFFF_IPoIB"))
        );
        // Each child is a devnode of its HCA, started with the port
        // client's stand-in bound from its INF.
        for (device, hca) in driver.devices().iter().zip(host.hcas()) {
            let bound = device.bound().expect("bound");
            let paths = started_children(&host, hca);
            assert_eq!(paths.len(), 2, "{paths:?}");
            for port in bound.ports() {
                let id = format!("{:016X}_FFFF_IPoIB", port.port_guid.get());
                assert!(paths.iter().any(|p| p.ends_with(&id)), "{id} in {paths:?}");
            }
            let child = host.pnp().children(hca)[0];
            let services = host.pnp().stack_services(child);
            assert!(
                services.iter().any(|(s, _)| s == "ibportclient"),
                "{services:?}"
            );
        }
    }
    finish(host);
}

#[test]
fn a_custom_list_gives_its_children_and_refuses_bad_entries() {
    let host = host(12);
    let driver = drivers(&host);
    host.boot();
    settle(&host);
    // The INF's list replaced (the INF writes it at install), read when
    // the stacks start again.
    add_entry(&host, "Srp", "IBA\\SRP", 0x8001);
    add_entry(&host, "Bad", "IBA\\A,B", 0xFFFF);
    set_list(&host, &["IPoIB", "Srp", "Bad"]);
    restart_all(&host);
    let children = filter_children(&driver);
    assert_eq!(children.len(), 8, "{children:?}");
    assert_eq!(children.iter().filter(|c| c.2 == "Srp").count(), 4);
    assert!(
        children
            .iter()
            .filter(|c| c.2 == "Srp")
            .all(|c| c.3.contains("_8001_"))
    );
    for device in driver.devices() {
        let list = device.child_list();
        assert_eq!(list.refused.len(), 1);
        assert_eq!(list.refused[0].name, "Bad");
    }
    for hca in host.hcas() {
        // Srp's children bind the port client through the compatible ID.
        let paths = started_children(&host, hca);
        assert_eq!(paths.len(), 4, "{paths:?}");
        assert_eq!(paths.iter().filter(|p| p.ends_with("_8001_Srp")).count(), 2);
    }
    finish(host);
}

#[test]
fn entries_added_and_removed_at_runtime_add_and_remove_children() {
    let host = host(13);
    let driver = drivers(&host);
    host.boot();
    settle(&host);
    assert_eq!(filter_children(&driver).len(), 4);

    // A second IPoIB partition appears.
    add_entry(&host, "IPoIB-8001", "IBA\\IPOIB", 0x8001);
    set_list(&host, &["IPoIB", "IPoIB-8001"]);
    driver.registry_changed();
    settle(&host);
    let children = filter_children(&driver);
    assert_eq!(children.len(), 8);
    for hca in host.hcas() {
        let paths = started_children(&host, hca);
        assert_eq!(paths.len(), 4, "{paths:?}");
        assert_eq!(paths.iter().filter(|p| p.contains("_8001_")).count(), 2);
    }

    // The default partition's entry is removed: its children go.
    set_list(&host, &["IPoIB-8001"]);
    driver.registry_changed();
    settle(&host);
    let children = filter_children(&driver);
    assert_eq!(children.len(), 4);
    assert!(children.iter().all(|c| c.2 == "IPoIB-8001"));
    for hca in host.hcas() {
        let paths = started_children(&host, hca);
        assert_eq!(paths.len(), 2, "{paths:?}");
        assert!(paths.iter().all(|p| p.contains("_8001_IPoIB-8001")));
    }
    finish(host);
}

#[test]
fn instance_ids_are_stable_across_a_restart_of_the_hca_stack_and_a_reboot() {
    let host = host(14);
    let driver = drivers(&host);
    host.boot();
    settle(&host);
    let before = filter_children(&driver);
    let paths_before: Vec<Vec<String>> = host
        .hcas()
        .iter()
        .map(|h| started_children(&host, *h))
        .collect();
    assert_eq!(before.len(), 4);

    let hca = host.hcas()[0];
    host.pnp().stop(hca).unwrap();
    settle(&host);
    assert_eq!(driver.registered_cas().len(), 1, "the stopped CA left");
    host.pnp().restart(hca);
    settle(&host);
    assert_eq!(driver.registered_cas().len(), 2, "and came back");
    assert_eq!(filter_children(&driver), before);
    let paths_after: Vec<Vec<String>> = host
        .hcas()
        .iter()
        .map(|h| started_children(&host, *h))
        .collect();
    assert_eq!(paths_after, paths_before);
    finish(host);

    // A reboot: another host with the same HCAs gives the same children.
    let host = self::host(99);
    let driver = drivers(&host);
    host.boot();
    settle(&host);
    assert_eq!(filter_children(&driver), before);
    let paths_rebooted: Vec<Vec<String>> = host
        .hcas()
        .iter()
        .map(|h| started_children(&host, *h))
        .collect();
    assert_eq!(paths_rebooted, paths_before);
    finish(host);
}

/// A function driver that answers the CI query with a version the filter
/// cannot use (0.9: a major below the required).
struct OldCiDriver;

struct OldCiDevice;

impl DeviceCallbacks for OldCiDevice {
    fn query_interface(&self, guid: &WinGuid, version: u16) -> Option<ProvidedInterface> {
        let old = InterfaceVersion::new(0, 9);
        (*guid == GUID_IB_CI_INTERFACE && old.packed() <= version).then(|| ProvidedInterface {
            version: old.packed(),
            object: Arc::new(()) as Arc<dyn Any + Send + Sync>,
        })
    }
}

impl DriverEntry for OldCiDriver {
    fn add_device(
        &self,
        _init: &DeviceInit,
        _host: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        Ok(Arc::new(OldCiDevice))
    }
}

#[test]
fn a_ci_version_mismatch_fails_the_filters_start_cleanly() {
    assert!(!InterfaceVersion::new(0, 9).satisfies(REQUIRED_CI_VERSION));
    let host = host(15);
    let driver = drivers(&host);
    host.register_driver("hcaminiport", Arc::new(OldCiDriver));
    host.boot();
    settle(&host);
    for hca in host.hcas() {
        let state = host.pnp().state(hca);
        let Some(PnpState::FailedStart(reason)) = &state else {
            panic!("{hca:?}: {state:?}");
        };
        // The filter's start failed, with STATUS_REVISION_MISMATCH.
        assert!(
            reason.contains("`ibalbus` prepare hardware failed"),
            "{reason}"
        );
        assert!(
            reason.contains("C0000059") || reason.contains("c0000059"),
            "{reason}"
        );
        assert!(host.pnp().children(hca).is_empty());
        assert_eq!(host.pnp().interface_references(hca), 0, "dereferenced");
    }
    assert!(driver.registered_cas().is_empty(), "nothing registered");
    assert!(driver.devices().iter().all(|d| d.bound().is_none()));
    assert_eq!(STATUS_REVISION_MISMATCH, NtStatus::from_raw(0xC000_0059));
    finish(host);
}

/// A port client that does what a kernel client of a port child does for
/// DMA: `IoGetDmaAdapter` on its PDO (the bus interface's
/// `GetDmaAdapter`), then a common buffer through that adapter, filled
/// with a pattern of its own.
#[derive(Default)]
struct DmaClient {
    devices: Mutex<Vec<Arc<DmaClientDevice>>>,
}

struct DmaClientDevice {
    host: DeviceServices,
    dma: Mutex<Option<(HostDmaAdapter, HostCommonBuffer)>>,
}

impl DriverEntry for DmaClient {
    fn add_device(
        &self,
        _init: &DeviceInit,
        host: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        let device = Arc::new(DmaClientDevice {
            host: host.clone(),
            dma: Mutex::default(),
        });
        self.devices.lock().unwrap().push(device.clone());
        Ok(device)
    }
}

impl DmaClientDevice {
    fn pattern(&self) -> Vec<u8> {
        // Distinct per device: its devnode's debug name, repeated.
        format!("{:?}", self.host.node())
            .bytes()
            .cycle()
            .take(64)
            .collect()
    }
}

impl DeviceCallbacks for DmaClientDevice {
    fn prepare_hardware(&self) -> NtStatus {
        let Some(bus) = self
            .host
            .query_interface(&GUID_BUS_INTERFACE_STANDARD, BUS_INTERFACE_STANDARD_VERSION)
        else {
            return NtStatus::NOT_SUPPORTED;
        };
        let adapter = bus.call(|b: &BusInterfaceStandard| b.get_dma_adapter());
        bus.dereference();
        let adapter = match adapter {
            Some(Ok(adapter)) => adapter,
            Some(Err(status)) => return status,
            None => return NtStatus::NOT_SUPPORTED,
        };
        let buffer = match adapter.alloc_common(4096) {
            Ok(buffer) => buffer,
            Err(status) => return status,
        };
        assert!(buffer.write(0, &self.pattern()));
        *self.dma.lock().unwrap() = Some((adapter, buffer));
        SUCCESS
    }

    fn release_hardware(&self) -> NtStatus {
        if let Some((adapter, buffer)) = self.dma.lock().unwrap().take() {
            adapter.free_common(buffer);
        }
        SUCCESS
    }
}

#[test]
fn a_childs_dma_adapter_is_its_hcas_own() {
    let host = host(16);
    let (_driver, miniport) = register_stack(&host);
    let client = Arc::new(DmaClient::default());
    host.register_driver("ibportclient", client.clone());
    host.boot();
    settle(&host);
    let clients = client.devices.lock().unwrap().clone();
    assert_eq!(clients.len(), 4, "one client per port of each HCA");

    let hca_of = |node: DevNodeId| {
        host.hcas()
            .into_iter()
            .find(|h| host.pnp().children(*h).contains(&node))
            .unwrap()
    };
    let adapter_of_hca = |hca: DevNodeId| {
        miniport
            .devices()
            .into_iter()
            .find(|d| d.node() == hca)
            .and_then(|d| d.adapter())
            .unwrap()
    };
    for client in &clients {
        let hca = hca_of(client.host.node());
        let hca_adapter = adapter_of_hca(hca);
        let dma = client.dma.lock().unwrap();
        let (adapter, buffer) = dma.as_ref().expect("the client got an adapter");
        assert_eq!(
            adapter.index(),
            hca_adapter.index(),
            "the HCA's own adapter"
        );
        // The HCA reaches the client's buffer at its bus address.
        let mut seen = vec![0; 64];
        hca_adapter
            .device_view()
            .read(buffer.bus_address(), &mut seen)
            .unwrap();
        assert_eq!(seen, client.pattern());
    }
    assert_eq!(host.verifier().violations(), []);

    // Through another adapter (the other HCA's children's), not: the
    // device's read faults, and the fault is recorded.
    let (a, b) = (&clients[0], &clients[clients.len() - 1]);
    assert_ne!(hca_of(a.host.node()), hca_of(b.host.node()));
    let hca_a = adapter_of_hca(hca_of(a.host.node()));
    let other_bus = b.dma.lock().unwrap().as_ref().unwrap().1.bus_address();
    let mut seen = vec![0; 64];
    assert!(hca_a.device_view().read(other_bus, &mut seen).is_err());
    let faults = host.verifier().take();
    assert_eq!(faults.len(), 1, "{faults:?}");
    assert!(matches!(faults[0].kind, ViolationKind::DmaFault { addr, .. } if addr == other_bus));
    // The bus interface references were given back.
    for client in &clients {
        assert_eq!(host.pnp().interface_references(client.host.node()), 0);
    }
    finish(host);
}

/// On the threaded host (the port query and its completion on worker
/// threads, racing the rest of the start) every HCA gets its children.
#[test]
fn children_appear_on_the_threaded_host_too() {
    for _ in 0..5 {
        let configs = hca_configs();
        let host = Host::new(HostConfig::threaded(2, configs)).unwrap();
        let driver = drivers(&host);
        host.boot();
        settle(&host);
        assert_eq!(filter_children(&driver).len(), 4);
        finish(host);
    }
}

/// HCAs leave in either order, by query-remove or surprise removal: the
/// one that left is deregistered and its children gone, the other keeps
/// its registration and children.
#[test]
fn hcas_leave_in_any_order_and_the_others_keep_their_children() {
    for (first, surprise) in [(0, false), (1, true)] {
        let host = host(17);
        let driver = drivers(&host);
        host.boot();
        settle(&host);
        let hcas = host.hcas();
        let (gone, kept) = (hcas[first], hcas[1 - first]);
        let kept_children = started_children(&host, kept);
        assert_eq!(kept_children.len(), 2);
        if surprise {
            host.pnp().surprise_remove(gone);
            host.pnp().remove_when_no_handles_remain(gone, 0);
        } else {
            host.pnp().query_and_remove(gone).unwrap();
        }
        settle(&host);
        let registered: Vec<u64> = driver.registered_cas().iter().map(|g| g.get()).collect();
        assert_eq!(registered, [HCAS[1 - first]], "surprise: {surprise}");
        assert!(started_children(&host, gone).is_empty());
        assert_eq!(started_children(&host, kept), kept_children);
        finish(host);
    }
}
