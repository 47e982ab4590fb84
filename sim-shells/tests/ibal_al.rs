//! Scenario: kernel clients of the access layer on the IBAL bus filter's
//! port children (`sim_shells::ibal_bus`), over the real miniport on two
//! HCAs with two ports each. A client driver bound to every child (the
//! `ibportclient` service of `inf/ib-port-client.inf`) gets the AL
//! interface from its PDO with the port's data, opens the AL with a
//! reference on its driver object, and closes it in its own
//! release-hardware; the tests drive its verbs through the interface and
//! through the IOCTL path of its PDO. Every test ends with the host shut
//! down and the verifier report empty.
#![cfg(not(windows))]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use driver_platform::Irql;
use hca_miniport_core::init::HcaConfig;
use ib_types::event::AsyncEventRecord;
use ib_types::interface::{AL_INTERFACE_VERSION, GUID_IB_AL_INTERFACE, InterfaceVersion};
use ib_types::scalars::PKey;
use ib_types::status::{IbStatus, NtStatus};
use ibal_bus_core::al::ClientEvents;
use sim_hca::device::DeviceConfig;
use sim_host::driver::{DeviceCallbacks, DeviceInit, DriverEntry, InterfaceRef, SUCCESS};
use sim_host::event::HostEvent;
use sim_host::host::{Host, HostConfig};
use sim_host::pnp::DeviceServices;
use sim_host::sched::SchedulerHandle;
use sim_host::verifier::ViolationKind;
use sim_shells::hca_miniport::MiniportDriver;
use sim_shells::ibal_bus::{AlClient, AlPortInterface, DriverObjectReference, IbalBusDriver};

/// Two HCAs, two ports each; port p of HCA i has the IPv4 address
/// 10.0.i.p.
const HCAS: [u64; 2] = [0x0002_C900_0000_1000, 0x0002_C900_0000_2000];

/// The port clients' service (`inf/ib-port-client.inf`).
const CLIENT: &str = "ibportclient";

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a client's callbacks saw: completion events (with the IRQL) and
/// async events.
#[derive(Default)]
struct Recorder {
    completions: Mutex<Vec<(u64, Irql)>>,
    events: Mutex<Vec<AsyncEventRecord>>,
}

impl ClientEvents for Recorder {
    fn completion(&self, cq: u64) {
        lock(&self.completions).push((cq, sim_host::irql::current()));
    }
    fn async_event(&self, event: &AsyncEventRecord) {
        lock(&self.events).push(*event);
    }
}

/// The AL as one client holds it.
struct Opened {
    interface: InterfaceRef,
    al: Arc<AlPortInterface>,
    client: AlClient,
}

/// The client driver: one device per port child.
struct ClientDriver {
    sched: SchedulerHandle,
    /// The host's count of references on the driver's objects (its record
    /// exists once the driver is registered).
    references: OnceLock<Arc<AtomicUsize>>,
    /// Drop the AL interface without dereferencing it (a broken client).
    leak_interface: bool,
    devices: Mutex<Vec<Arc<PortClient>>>,
}

struct PortClient {
    host: DeviceServices,
    sched: SchedulerHandle,
    references: Arc<AtomicUsize>,
    leak_interface: bool,
    opened: Mutex<Option<Opened>>,
    recorder: Arc<Recorder>,
    /// What its close in release-hardware returned.
    closed: Mutex<Option<Result<(), IbStatus>>>,
}

impl DriverEntry for ClientDriver {
    fn add_device(
        &self,
        _init: &DeviceInit,
        host: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        let device = Arc::new(PortClient {
            host: host.clone(),
            sched: self.sched.clone(),
            references: self.references.get().cloned().unwrap_or_default(),
            leak_interface: self.leak_interface,
            opened: Mutex::default(),
            recorder: Arc::default(),
            closed: Mutex::default(),
        });
        lock(&self.devices).push(device.clone());
        Ok(device)
    }
}

impl DeviceCallbacks for PortClient {
    /// Gets the AL interface from its PDO and opens the AL.
    fn prepare_hardware(&self) -> NtStatus {
        let Some(interface) = self
            .host
            .query_interface(&GUID_IB_AL_INTERFACE, AL_INTERFACE_VERSION.packed())
        else {
            return NtStatus::NOT_SUPPORTED;
        };
        let Some(al) = interface.get::<Arc<AlPortInterface>>().cloned() else {
            interface.dereference();
            return NtStatus::INVALID_DEVICE_STATE;
        };
        let reference = Box::new(DriverObjectReference::new(self.references.clone()));
        match al.open(reference, self.recorder.clone()) {
            Ok(client) => {
                *lock(&self.opened) = Some(Opened {
                    interface,
                    al,
                    client,
                });
                SUCCESS
            }
            Err(status) => {
                interface.dereference();
                status.to_ntstatus()
            }
        }
    }

    /// Closes the AL (it destroyed its objects before) and gives the
    /// interface back.
    fn release_hardware(&self) -> NtStatus {
        if let Some(opened) = lock(&self.opened).take() {
            let drained = Arc::new(HostEvent::new(self.sched.clone()));
            *lock(&self.closed) = Some(opened.al.close(opened.client, drained));
            if self.leak_interface {
                drop(opened.interface);
            } else {
                opened.interface.dereference();
            }
        }
        SUCCESS
    }
}

impl PortClient {
    fn al(&self) -> (Arc<AlPortInterface>, AlClient) {
        let opened = lock(&self.opened);
        let opened = opened.as_ref().expect("the client opened the AL");
        (opened.al.clone(), opened.client)
    }
}

struct World {
    host: Host,
    driver: Arc<IbalBusDriver>,
    clients: Arc<ClientDriver>,
}

fn world(seed: u64, leak_interface: bool) -> World {
    let configs = HCAS
        .iter()
        .enumerate()
        .map(|(i, guid)| {
            let i = i as u8;
            DeviceConfig::with_ports(*guid, &[[10, 0, i, 1], [10, 0, i, 2]])
        })
        .collect();
    let host = Host::new(HostConfig::deterministic(seed, configs)).unwrap();
    let _log = sim_host::samples::register_stand_ins(&host);
    MiniportDriver::register(&host, HcaConfig::default());
    let driver = IbalBusDriver::register(&host);
    let clients = Arc::new(ClientDriver {
        sched: host.scheduler_handle(),
        references: OnceLock::new(),
        leak_interface,
        devices: Mutex::default(),
    });
    host.register_driver(CLIENT, clients.clone());
    let references = host.pnp().driver_references(CLIENT).unwrap();
    assert!(clients.references.set(references).is_ok());
    host.boot();
    settle(&host);
    World {
        host,
        driver,
        clients,
    }
}

fn settle(host: &Host) {
    host.scheduler().run_until_idle(1_000_000).unwrap();
    host.pnp().process_bus_relations();
    host.scheduler().run_until_idle(1_000_000).unwrap();
}

fn finish(host: Host) {
    host.shut_down();
    host.verifier().assert_clean();
}

impl World {
    fn references(&self) -> usize {
        self.host
            .pnp()
            .driver_references(CLIENT)
            .unwrap()
            .load(Ordering::Acquire)
    }
}

#[test]
fn a_kernel_client_on_a_child_gets_the_al_interface_with_its_ports_data_counted() {
    let w = world(21, false);
    let devices = lock(&w.clients.devices).clone();
    assert_eq!(devices.len(), 4, "one client per port of each HCA");
    for client in &devices {
        let (al, _) = client.al();
        let data = al.port_data();
        let node = client.host.node();
        // The data is the child's: its CA, port, port GUID and P_Key.
        let filter_child = w
            .driver
            .devices()
            .iter()
            .flat_map(|d| d.children())
            .find(|c| {
                w.host
                    .pnp()
                    .instance_path(node)
                    .is_some_and(|p| p.ends_with(c.instance_id()))
            })
            .expect("the client's child");
        assert_eq!(data.ca_guid, filter_child.ca_guid);
        assert_eq!(data.port_guid, filter_child.port_guid);
        assert_eq!(data.port, filter_child.port_num);
        assert_eq!(data.pkey, PKey::new(0xFFFF));
        let opened = lock(&client.opened);
        let version = opened.as_ref().unwrap().interface.version();
        assert_eq!(InterfaceVersion::from_packed(version), AL_INTERFACE_VERSION);
        // The client's reference is counted against its child.
        assert_eq!(w.host.pnp().interface_references(node), 1);
    }
    // Asked at a newer minor, the child answers with its own version (the
    // closest not above); below its version, not at all.
    let node = devices[0].host.node();
    let newer = InterfaceVersion::new(1, 7).packed();
    let answered = w
        .host
        .pnp()
        .query_interface(node, &GUID_IB_AL_INTERFACE, newer)
        .expect("answered");
    assert_eq!(answered.version(), AL_INTERFACE_VERSION.packed());
    answered.dereference();
    let older = InterfaceVersion::new(0, 9).packed();
    assert!(
        w.host
            .pnp()
            .query_interface(node, &GUID_IB_AL_INTERFACE, older)
            .is_none()
    );
    // Every client holds one reference on the client driver's object.
    assert_eq!(w.references(), 4);
    let World { host, clients, .. } = w;
    finish(host);
    // Each closed its AL at its removal, before the HCA's filter let go.
    for client in lock(&clients.devices).iter() {
        assert_eq!(*lock(&client.closed), Some(Ok(())));
        assert_eq!(client.references.load(Ordering::Acquire), 0);
    }
}

#[test]
fn a_leaked_al_interface_reference_is_the_hosts_reference_leak() {
    let w = world(22, true);
    w.host.shut_down();
    let leaks = w
        .host
        .verifier()
        .take()
        .into_iter()
        .filter(|v| {
            matches!(&v.kind, ViolationKind::ReferenceLeak { what } if what.contains(&GUID_IB_AL_INTERFACE.to_string()))
        })
        .count();
    assert_eq!(leaks, 4, "one per client");
}
