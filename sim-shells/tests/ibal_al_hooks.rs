//! The bus filter's last access-layer hooks (`sim_shells::ibal_bus`,
//! docs/ibal-bus.md): after a port event the filter re-queries the CA's
//! ports and tells every open client what changed in a port's tables
//! (`AccessLayer::port_changed`: a P_Key table change as `PkeyChange`).
//! Over the real miniport on one simulated HCA with two ports; every test
//! ends with the host shut down and the verifier report empty.
//!
//! The other hook, `AccessLayer::destroy_orphans` at release-hardware, has
//! no test here: an orphan needs the CA to refuse a destroy the AL sends
//! at a client's close, and neither the miniport nor the simulated HCA
//! refuses one the AL's own dependency order allows (each refusal they
//! have, a PD or CQ still in use, the AL prevents first). The core's
//! `access_layer_close` tests cover what `destroy_orphans` does.
#![cfg(not(windows))]

use std::sync::{Arc, Mutex};

use hca_miniport_core::cmd::Command;
use hca_miniport_core::init::HcaConfig;
use hca_prm::cmd::{Opcode, port_table_in_mod};
use ib_types::event::{AsyncEventCode, AsyncEventRecord};
use ib_types::interface::{AL_INTERFACE_VERSION, GUID_IB_AL_INTERFACE};
use ib_types::scalars::PortNum;
use ib_types::status::{IbStatus, NtStatus};
use ibal_bus_core::al::ClientEvents;
use sim_hca::device::DeviceConfig;
use sim_host::driver::{DeviceCallbacks, DeviceInit, DriverEntry, InterfaceRef, SUCCESS};
use sim_host::event::HostEvent;
use sim_host::host::{Host, HostConfig};
use sim_host::pnp::DeviceServices;
use sim_host::sched::SchedulerHandle;
use sim_shells::hca_miniport::MiniportDriver;
use sim_shells::ibal_bus::{AlClient, AlPortInterface, DriverObjectReference, IbalBusDriver};

const HCA: u64 = 0x0002_C900_0000_3000;

/// The port clients' service (`inf/ib-port-client.inf`).
const CLIENT: &str = "ibportclient";

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Default)]
struct Recorder {
    events: Mutex<Vec<AsyncEventRecord>>,
}

impl ClientEvents for Recorder {
    fn completion(&self, _cq: u64) {}
    fn async_event(&self, event: &AsyncEventRecord) {
        lock(&self.events).push(*event);
    }
}

struct Opened {
    interface: InterfaceRef,
    al: Arc<AlPortInterface>,
    client: AlClient,
}

/// A client on every port child: opens the AL at prepare-hardware,
/// closes it (destroying what it left) at release-hardware.
struct ClientDriver {
    sched: SchedulerHandle,
    devices: Mutex<Vec<Arc<PortClient>>>,
}

struct PortClient {
    host: DeviceServices,
    sched: SchedulerHandle,
    opened: Mutex<Option<Opened>>,
    recorder: Arc<Recorder>,
    port: Mutex<Option<u8>>,
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
            opened: Mutex::default(),
            recorder: Arc::default(),
            port: Mutex::default(),
            closed: Mutex::default(),
        });
        lock(&self.devices).push(device.clone());
        Ok(device)
    }
}

impl DeviceCallbacks for PortClient {
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
        *lock(&self.port) = Some(al.port_data().port.get());
        let reference = Box::new(DriverObjectReference::new(Arc::default()));
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

    fn release_hardware(&self) -> NtStatus {
        if let Some(opened) = lock(&self.opened).take() {
            let drained = Arc::new(HostEvent::new(self.sched.clone()));
            *lock(&self.closed) = Some(opened.al.close(opened.client, drained));
            opened.interface.dereference();
        }
        SUCCESS
    }
}

struct World {
    host: Host,
    miniport: Arc<MiniportDriver<sim_host::platform::SimPlatform>>,
    clients: Arc<ClientDriver>,
}

fn world(seed: u64) -> World {
    let configs = vec![DeviceConfig::with_ports(
        HCA,
        &[[10, 0, 9, 1], [10, 0, 9, 2]],
    )];
    let host = Host::new(HostConfig::deterministic(seed, configs)).unwrap();
    let _log = sim_host::samples::register_stand_ins(&host);
    let miniport = MiniportDriver::register(&host, HcaConfig::default());
    IbalBusDriver::register(&host);
    let clients = Arc::new(ClientDriver {
        sched: host.scheduler_handle(),
        devices: Mutex::default(),
    });
    host.register_driver(CLIENT, clients.clone());
    host.boot();
    settle(&host);
    World {
        host,
        miniport,
        clients,
    }
}

fn settle(host: &Host) {
    let run = || {
        if host.scheduler().quiesce().is_err() {
            host.scheduler().run_until_idle(1_000_000).unwrap();
        }
    };
    run();
    host.pnp().process_bus_relations();
    run();
}

impl World {
    fn client(&self, port: u8) -> Arc<PortClient> {
        lock(&self.clients.devices)
            .iter()
            .find(|c| *lock(&c.port) == Some(port))
            .cloned()
            .expect("a client on that port")
    }

    /// Runs `f` on the simulated HCA (link control), then lets the
    /// events it raised run.
    fn with_hca(&self, f: impl FnOnce(&mut sim_hca::device::Device)) {
        let device = self.miniport.devices()[0].clone();
        device
            .function()
            .expect("the HCA's function")
            .with_device(f);
        settle(&self.host);
    }

    /// The port's link goes down and comes back: PortDown, PortActive.
    fn bounce_link(&self, port: u8) {
        self.with_hca(|d| d.set_link(port, false));
        self.with_hca(|d| d.set_link(port, true));
    }

    /// Entry `index` of port `port`'s P_Key table becomes `pkey`, by the
    /// miniport's own firmware command (`SET_PKEY`, PRM; what a subnet
    /// manager agent's update does): the CA raises no event for it.
    fn set_pkey(&self, port: u8, index: u16, pkey: u16) {
        let hca = self.miniport.devices()[0].hca().expect("started");
        let done = Arc::new(Mutex::new(None));
        let out = done.clone();
        hca.submit(
            Command::new(Opcode::SetPkey, port_table_in_mod(port, index))
                .with_immediate(u64::from(pkey)),
            Box::new(move |r| *lock(&out) = Some(r.is_ok())),
        );
        settle(&self.host);
        assert_eq!(lock(&done).take(), Some(true), "SET_PKEY done");
    }
}

fn port_event(code: AsyncEventCode, port: u8) -> AsyncEventRecord {
    AsyncEventRecord::new(code, 0, Some(PortNum::new(port).unwrap()), 0).unwrap()
}

/// Shuts the host down: every client closed its AL cleanly, and the
/// verifier saw nothing wrong.
fn finish(w: World) {
    w.host.shut_down();
    for client in lock(&w.clients.devices).iter() {
        assert_eq!(*lock(&client.closed), Some(Ok(())));
    }
    w.host.verifier().assert_clean();
}

/// A P_Key table change the CA raised no event for reaches every client
/// as `PkeyChange` once the port's next event has the filter re-query it;
/// a port event with the tables unchanged tells nothing more.
#[test]
fn a_pkey_table_change_reaches_every_client_after_the_ports_next_event() {
    let w = world(41);
    let (one, two) = (w.client(1), w.client(2));
    assert!(lock(&one.recorder.events).is_empty());

    // Unchanged tables: the CA's own events only.
    w.bounce_link(2);
    let bounced = [
        port_event(AsyncEventCode::PortDown, 2),
        port_event(AsyncEventCode::PortActive, 2),
    ];
    for client in [&one, &two] {
        assert_eq!(*lock(&client.recorder.events), bounced);
    }

    // Port 1's P_Key table changes silently; its next PortActive has the
    // filter find it.
    w.set_pkey(1, 1, 0x8001);
    for client in [&one, &two] {
        assert_eq!(*lock(&client.recorder.events), bounced, "nothing yet");
    }
    w.bounce_link(1);
    let mut expected = bounced.to_vec();
    expected.extend([
        port_event(AsyncEventCode::PortDown, 1),
        port_event(AsyncEventCode::PortActive, 1),
        port_event(AsyncEventCode::PkeyChange, 1),
    ]);
    for client in [&one, &two] {
        assert_eq!(*lock(&client.recorder.events), expected);
    }

    // Known now: another bounce tells no change again.
    w.bounce_link(1);
    expected.extend([
        port_event(AsyncEventCode::PortDown, 1),
        port_event(AsyncEventCode::PortActive, 1),
    ]);
    assert_eq!(*lock(&one.recorder.events), expected);
    finish(w);
}
