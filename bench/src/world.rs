//! The machine every measurement runs on: a threaded simulated host (worker
//! threads for DPCs and work items, a timer thread; the HCAs on a lossless
//! fast fabric, each device running in the thread that rings it) with two
//! HCAs of two ports each, the real miniport (`sim_shells::hca_miniport`)
//! and the real IBAL bus filter (`sim_shells::ibal_bus`) bound from our
//! INFs, and a user process reaching the stack through the access library's
//! threaded OS seam (`sim_shells::user_io::ThreadedSimIo`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use hca_miniport_core::hca::Hca;
use hca_miniport_core::init::HcaConfig;
use ibal_user::DeviceIo;
use sim_hca::device::DeviceConfig;
use sim_host::host::{Host, HostConfig};
use sim_host::memory::Process;
use sim_host::platform::SimPlatform;
use sim_shells::hca_miniport::MiniportDriver;
use sim_shells::ibal_bus::IbalBusDriver;
use sim_shells::user_io::ThreadedSimIo;

/// The HCAs' node GUIDs.
pub const GUIDS: [u64; 2] = [0x0002_C900_0000_B000, 0x0002_C900_0000_C000];

/// Port `port` (1 or 2) of HCA `hca`'s IPv4 address (its GID).
pub fn port_ip(hca: usize, port: u8) -> [u8; 4] {
    [10, 9, (2 * hca) as u8 + port - 1, 1]
}

/// Worker threads of the host. They block when idle (no spinning), so a
/// measurement's spinning threads stay the only ones competing for cores.
const WORKERS: usize = 2;

/// A booted threaded machine with the real drivers.
pub struct World {
    /// The simulated Windows machine.
    pub host: Arc<Host>,
    /// The miniport's simulated-host shell.
    pub miniport: Arc<MiniportDriver<SimPlatform>>,
    /// The bus filter's simulated-host shell.
    pub filter: Arc<IbalBusDriver>,
}

impl std::fmt::Debug for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("World").finish_non_exhaustive()
    }
}

impl World {
    /// Boots the machine with HCAs whose QP tables hold `2^log_qps` QPs
    /// (the miniport's default configuration otherwise), and waits (up to
    /// 20 s) until both HCAs are up with their four port children
    /// reported.
    pub fn boot(log_qps: u8) -> Self {
        Self::boot_with(log_qps, HcaConfig::default())
    }

    /// [`Self::boot`] with the miniport configured by `config`.
    pub fn boot_with(log_qps: u8, config: HcaConfig) -> Self {
        let devices = GUIDS
            .iter()
            .enumerate()
            .map(|(i, guid)| {
                let mut device = DeviceConfig::with_ports(*guid, &[port_ip(i, 1), port_ip(i, 2)]);
                device.limits.log_max_qps = log_qps;
                device
            })
            .collect();
        let host =
            Arc::new(Host::new(HostConfig::threaded(WORKERS, devices)).expect("a threaded host"));
        // Stand-ins for the drivers of the devnodes that are not ours.
        let _log = sim_host::samples::register_stand_ins(&host);
        let miniport = MiniportDriver::register(&host, config);
        let filter = IbalBusDriver::register(&host);
        host.boot();
        let world = Self {
            host,
            miniport,
            filter,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let _ = world.host.scheduler().quiesce();
            world.host.pnp().process_bus_relations();
            let started = world.miniport.devices().len() == GUIDS.len()
                && world
                    .miniport
                    .devices()
                    .iter()
                    .all(|d| matches!(d.started(), Some(Ok(_))));
            let children: usize = world
                .filter
                .devices()
                .iter()
                .map(|d| d.children().len())
                .sum();
            if started && children == 2 * GUIDS.len() {
                return world;
            }
            assert!(Instant::now() < deadline, "the machine did not come up");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The access library's OS seam for `process` on this machine.
    pub fn io(&self, process: &Process) -> Arc<dyn DeviceIo> {
        ThreadedSimIo::new(&self.host, process)
    }

    /// The miniport's core of HCA `at`.
    pub fn hca(&self, at: usize) -> Arc<Hca<SimPlatform>> {
        let node = self.host.hcas()[at];
        self.miniport
            .devices()
            .into_iter()
            .find(|d| d.node() == node)
            .and_then(|d| d.hca())
            .expect("the miniport of that HCA")
    }

    /// The kernel CA handle of HCA `at`: the one the bus filter opened
    /// (the miniport takes one kernel open per HCA, and the filter holds
    /// it), which the AL itself names in its CI calls.
    pub fn kernel_ca(&self, at: usize) -> u64 {
        self.filter
            .devices()
            .iter()
            .filter_map(|device| device.bound())
            .find(|bound| bound.identity().ca_guid.get() == GUIDS[at])
            .map(|bound| bound.ca_handle())
            .expect("the bus filter bound the HCA")
    }

    /// Shuts the machine down; the verifier's findings, if any.
    pub fn finish(self) -> Vec<String> {
        self.host.shut_down();
        self.host
            .verifier()
            .violations()
            .iter()
            .map(|v| format!("{v:?}"))
            .collect()
    }
}
