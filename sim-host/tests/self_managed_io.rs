//! `EvtDeviceSelfManagedIoInit` (docs/host-model.md "Self-managed I/O
//! init"): called after each start of a stack, once the devnode takes
//! requests. A request a filter sends down its own stack from its D0 entry
//! during the first start is refused (the devnode is not started yet); the
//! same request sent from self-managed I/O init travels down the stack to
//! its bottom. Not called on resume.

use std::sync::{Arc, Mutex};

use driver_platform::{DevicePowerState, RequestorMode, SystemPowerState};
use ib_types::status::NtStatus;
use sim_hca::device::DeviceConfig;
use sim_host::driver::{DeviceCallbacks, DeviceInit, DriverEntry, SUCCESS};
use sim_host::host::{Host, HostConfig};
use sim_host::pnp::DeviceServices;
use sim_host::request::{HostRequest, RequestHandle};

/// An upper filter that sends a request down its own stack from D0 entry
/// and from self-managed I/O init, and records where each ended.
#[derive(Default)]
struct Probe {
    log: Arc<Mutex<Vec<(&'static str, RequestHandle)>>>,
}

struct ProbeDevice {
    host: DeviceServices,
    log: Arc<Mutex<Vec<(&'static str, RequestHandle)>>>,
}

impl ProbeDevice {
    fn send(&self, from: &'static str) {
        let verifier = self.host.verifier().unwrap();
        let (request, issuer) =
            HostRequest::new(&verifier, 0x0022_0000, RequestorMode::Kernel, vec![], 0);
        self.log.lock().unwrap().push((from, issuer));
        self.host.send_to_own_device(request);
    }
}

impl DriverEntry for Probe {
    fn add_device(
        &self,
        _init: &DeviceInit,
        host: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        Ok(Arc::new(ProbeDevice {
            host: host.clone(),
            log: self.log.clone(),
        }))
    }
}

impl DeviceCallbacks for ProbeDevice {
    fn d0_entry(&self, _from: DevicePowerState) -> NtStatus {
        self.send("d0 entry");
        SUCCESS
    }
    fn self_managed_io_init(&self) {
        self.send("self-managed io init");
    }
    fn power_managed_queue(&self) -> bool {
        false
    }
}

#[test]
fn self_managed_io_init_runs_once_the_stack_takes_requests() {
    let cfg = DeviceConfig::with_ports(0x0002_C900_0000_1000, &[[10, 0, 0, 1]]);
    let host = Host::new(HostConfig::deterministic(3, vec![cfg])).unwrap();
    let _log = sim_host::samples::register_stand_ins(&host);
    let probe = Probe::default();
    let log = probe.log.clone();
    host.register_driver("ibalbus", Arc::new(probe));
    host.boot();
    host.scheduler().run_until_idle(100_000).unwrap();
    let outcome = |log: &[(&'static str, RequestHandle)]| -> Vec<(&'static str, u32)> {
        log.iter()
            .map(|(from, issuer)| (*from, issuer.completion().unwrap().status.raw()))
            .collect()
    };
    // DELETE_PENDING: refused by the host while the devnode starts;
    // NOT_SUPPORTED: passed down to the PCI PDO, which handles no IOCTL.
    assert_eq!(
        outcome(&log.lock().unwrap()),
        [
            ("d0 entry", 0xC000_0056),
            ("self-managed io init", 0xC000_00BB)
        ]
    );

    // Not on resume from sleep. (Again after a stop and restart: the
    // stand-in miniport cannot restart; `sim-shells` `ibal_bus.rs`
    // `instance_ids_are_stable_across_a_restart_of_the_hca_stack_and_a_reboot`
    // shows the real filter binding again from it.)
    log.lock().unwrap().clear();
    host.pnp().set_system_power(SystemPowerState::S3).unwrap();
    host.pnp().set_system_power(SystemPowerState::S0).unwrap();
    host.scheduler().run_until_idle(100_000).unwrap();
    assert_eq!(
        log.lock()
            .unwrap()
            .iter()
            .map(|(f, _)| *f)
            .collect::<Vec<_>>(),
        ["d0 entry"]
    );
    host.shut_down();
    host.verifier().assert_clean();
}
