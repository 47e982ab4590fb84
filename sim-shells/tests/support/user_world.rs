//! The user-mode tests' machine: two HCAs of two ports each (the GUIDs in
//! [`HCAS`]) with the real miniport and the real IBAL bus filter, a
//! process's OS seam on it, and what a test ends with (nothing of the
//! process left, an empty verifier report).

#![allow(dead_code, reason = "each test binary uses part of the machine")]

use std::sync::Arc;

use hca_miniport_core::hca::Hca;
use hca_miniport_core::init::HcaConfig;
use ibal_user::DeviceIo;
use sim_hca::device::DeviceConfig;
use sim_host::host::{Host, HostConfig};
use sim_host::memory::Process;
use sim_host::platform::SimPlatform;
use sim_shells::hca_miniport::MiniportDriver;
use sim_shells::ibal_bus::{IbalBusDevice, IbalBusDriver};
use sim_shells::user_io::{SimIo, settle};

/// The CA GUIDs of the two HCAs, in bus order.
pub(crate) const HCAS: [u64; 2] = [0x0002_C900_0000_7000, 0x0002_C900_0000_8000];

/// The booted machine.
pub(crate) struct UserWorld {
    /// The machine.
    pub host: Arc<Host>,
    /// The IBAL bus filter's driver.
    pub filter: Arc<IbalBusDriver>,
    /// The miniport's driver.
    pub miniport: Arc<MiniportDriver<SimPlatform>>,
}

impl UserWorld {
    /// Boots the machine from `seed`.
    pub(crate) fn new(seed: u64) -> Self {
        let configs = HCAS
            .iter()
            .enumerate()
            .map(|(i, guid)| {
                let i = i as u8;
                DeviceConfig::with_ports(*guid, &[[10, 2, i, 1], [10, 2, i, 2]])
            })
            .collect();
        let host = Arc::new(Host::new(HostConfig::deterministic(seed, configs)).unwrap());
        let _log = sim_host::samples::register_stand_ins(&host);
        let miniport = MiniportDriver::register(&host, HcaConfig::default());
        let filter = IbalBusDriver::register(&host);
        host.boot();
        settle(&host);
        host.pnp().process_bus_relations();
        settle(&host);
        Self {
            host,
            filter,
            miniport,
        }
    }

    /// The OS seam of `process` on this machine.
    pub(crate) fn io(&self, process: &Process) -> Arc<dyn DeviceIo> {
        SimIo::new(&self.host, process)
    }

    /// The miniport's HCA at `at`.
    pub(crate) fn hca(&self, at: usize) -> Arc<Hca<SimPlatform>> {
        let node = self.host.hcas()[at];
        self.miniport
            .devices()
            .into_iter()
            .find(|d| d.node() == node)
            .and_then(|d| d.hca())
            .expect("the miniport of that HCA")
    }

    /// The filter's device (and proxy) of the HCA at `at`.
    pub(crate) fn proxy(&self, at: usize) -> Arc<IbalBusDevice> {
        self.filter.devices()[at].clone()
    }

    /// Objects the proxies record, user contexts the miniports hold, and
    /// the process's handles, pages locked and device mappings.
    pub(crate) fn leftovers(&self, process: &Process) -> [usize; 5] {
        [
            (0..2).map(|i| self.proxy(i).proxy().object_count()).sum(),
            (0..2).map(|i| self.hca(i).user_context_count()).sum(),
            self.host.pnp().process_handle_count(process),
            process.space().locked_pages(),
            process.space().device_mapping_count(),
        ]
    }

    /// Ends a test: nothing of `process` left, it exits cleanly, the host
    /// shuts down with an empty verifier report.
    pub(crate) fn finish_with(self, process: &Process) {
        assert_eq!(self.leftovers(process), [0; 5], "nothing left open");
        assert_eq!(process.exit(), 0, "no page left locked");
        self.finish();
    }

    /// Ends a test: the host shuts down with an empty verifier report.
    pub(crate) fn finish(self) {
        self.host.shut_down();
        self.host.verifier().assert_clean();
    }
}
