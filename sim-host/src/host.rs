//! One simulated Windows machine, assembled: verifier, scheduler, PnP
//! manager binding from our INF files, registry, kernel pool, IOMMU, and a
//! PCI bus over the simulated HCAs. Tests and the main job register their
//! in-process drivers under their service names, then [`Host::boot`].

use std::sync::Arc;

use ib_types::status::NtStatus;
use sim_hca::cluster::ClusterError;
use sim_hca::device::DeviceConfig;
use sim_hca::fabric::FabricConfig;
use sim_hca::udp::PortAddress;

use crate::binder::InfBinder;
use crate::dma::Iommu;
use crate::driver::{DeviceCallbacks, DriverEntry};
use crate::inf::{InfSet, LoadError, workspace_inf_dir};
use crate::memory::Pool;
use crate::pci::{Backplane, PCI_ROOT_HARDWARE_ID, PCI_SERVICE, PciBusDriver};
use crate::pnp::{DevNodeId, PnpManager};
use crate::registry::RegistryStore;
use crate::sched::{Mode, Scheduler, SchedulerHandle};
use crate::verifier::Verifier;

/// Instance path of the PCI root bus.
pub const PCI_ROOT_INSTANCE: &str = "ACPI\\PNP0A08\\0";

/// What machine to build.
#[derive(Debug, Clone)]
pub struct HostConfig {
    /// Every random choice (scheduling order, bus addresses, fabric
    /// faults) derives from this seed.
    pub seed: u64,
    /// Deterministic (seeded, virtual time, one thread) or threaded.
    pub mode: Mode,
    /// Worker threads in threaded mode.
    pub workers: usize,
    /// The HCAs on the PCI bus, function 0 first.
    pub hcas: Vec<DeviceConfig>,
    /// The fabric between them (deterministic mode; threaded mode wires
    /// them back to back).
    pub fabric: FabricConfig,
    /// Threaded mode: `Some` puts the HCAs' ports on the UDP fabric
    /// (`sim_hca::udp`), each a real UDP endpoint at its address here (in
    /// port order, function 0's first; ports beyond them take the first
    /// free 127.0.0.x), instead of back to back.
    pub udp: Option<Vec<PortAddress>>,
}

impl HostConfig {
    /// A deterministic machine with `hcas`.
    pub fn deterministic(seed: u64, hcas: Vec<DeviceConfig>) -> Self {
        Self {
            seed,
            mode: Mode::Deterministic,
            workers: 0,
            hcas,
            fabric: FabricConfig::default(),
            udp: None,
        }
    }

    /// A threaded machine with `hcas` whose ports are real UDP endpoints
    /// at `addresses` ([`HostConfig::udp`]): machines in different
    /// processes, or in one, reach each other over real datagrams.
    pub fn threaded_udp(
        workers: usize,
        hcas: Vec<DeviceConfig>,
        addresses: Vec<PortAddress>,
    ) -> Self {
        Self {
            udp: Some(addresses),
            ..Self::threaded(workers, hcas)
        }
    }

    /// A threaded machine with `hcas`.
    pub fn threaded(workers: usize, hcas: Vec<DeviceConfig>) -> Self {
        Self {
            seed: 0,
            mode: Mode::Threaded,
            workers,
            hcas,
            fabric: FabricConfig::default(),
            udp: None,
        }
    }
}

/// Why a machine could not be built.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// The INF directory could not be read.
    #[error(transparent)]
    Inf(#[from] LoadError),
    /// The HCAs did not fit on the fabric.
    #[error(transparent)]
    Fabric(#[from] ClusterError),
    /// A thread could not be started.
    #[error("starting host threads: {0}")]
    Threads(#[source] std::io::Error),
    /// A port's UDP endpoint could not be bound ([`HostConfig::udp`]).
    #[error("binding the UDP fabric's endpoints: {0}")]
    Udp(#[source] std::io::Error),
}

/// One simulated machine.
pub struct Host {
    verifier: Verifier,
    sched: Scheduler,
    pnp: PnpManager,
    registry: RegistryStore,
    pool: Pool,
    iommu: Iommu,
    backplane: Arc<Backplane>,
    pci_bus: Arc<PciBusDriver>,
}

impl std::fmt::Debug for Host {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Host")
            .field("backplane", &self.backplane)
            .finish_non_exhaustive()
    }
}

/// The PDO of the root bus, which no driver owns.
struct RootPdo;
impl DeviceCallbacks for RootPdo {
    fn power_managed_queue(&self) -> bool {
        false
    }
}

impl Host {
    /// Builds the machine: nothing is enumerated until [`Host::boot`], so
    /// drivers can be registered first.
    pub fn new(cfg: HostConfig) -> Result<Self, HostError> {
        let verifier = Verifier::new();
        let (sched, backplane) = match cfg.mode {
            Mode::Deterministic => {
                let sched = Scheduler::deterministic(cfg.seed, verifier.clone());
                let backplane =
                    Backplane::stepped(cfg.fabric, cfg.seed, sched.handle(), cfg.hcas.clone())?;
                (sched, backplane)
            }
            Mode::Threaded => (
                Scheduler::threaded(cfg.workers.max(1), verifier.clone())
                    .map_err(HostError::Threads)?,
                match &cfg.udp {
                    Some(addresses) => {
                        Backplane::udp(verifier.clone(), cfg.hcas.clone(), addresses)
                            .map_err(HostError::Udp)?
                    }
                    None => Backplane::threaded(verifier.clone(), cfg.hcas.clone())
                        .map_err(HostError::Threads)?,
                },
            ),
        };
        let registry = RegistryStore::new();
        let binder = InfBinder::new(InfSet::load_dir(workspace_inf_dir())?, registry.clone())
            .with_builtin(PCI_ROOT_HARDWARE_ID, PCI_SERVICE);
        let pnp = PnpManager::with_registry(verifier.clone(), Box::new(binder), registry.clone());
        pnp.set_scheduler(sched.handle());
        // Windows promises no order between unrelated devnodes at a sleep:
        // the machine draws one of the valid orders from its seed, so a
        // driver relying on an accidental order fails under some seed.
        pnp.set_power_order(crate::power::PowerOrder::Seeded(cfg.seed));
        let pool = Pool::new(verifier.clone());
        let iommu = Iommu::new(verifier.clone(), cfg.seed);
        let pci_bus = Arc::new(PciBusDriver::new(
            backplane.clone(),
            (0..cfg.hcas.len()).collect(),
            iommu.clone(),
        ));
        pnp.register_driver(PCI_SERVICE, pci_bus.clone());
        // Whatever a driver leaves in pool when it unloads is a leak.
        let leak_pool = pool.clone();
        pnp.on_unload(move |service| {
            leak_pool.report_leaks(service);
        });
        Ok(Self {
            verifier,
            sched,
            pnp,
            registry,
            pool,
            iommu,
            backplane,
            pci_bus,
        })
    }

    /// Registers an in-process driver under the service name its INF
    /// installs.
    pub fn register_driver(&self, service: &str, entry: Arc<dyn DriverEntry>) {
        self.pnp.register_driver(service, entry);
    }

    /// Enumerates the PCI root bus: its functions bind and start, and
    /// their drivers' children after them. Returns the root bus devnode.
    pub fn boot(&self) -> DevNodeId {
        self.pnp.add_device(
            None,
            PCI_ROOT_INSTANCE,
            vec![PCI_ROOT_HARDWARE_ID.to_owned()],
            Vec::new(),
            Arc::new(RootPdo),
        )
    }

    /// The HCA devnodes in the device tree (a removed one is no longer
    /// there), function 0 first; of a function plugged in again
    /// ([`Host::replug_hca`]), its newest devnode.
    pub fn hcas(&self) -> Vec<DevNodeId> {
        let children = self
            .pnp
            .find(PCI_ROOT_INSTANCE)
            .map(|root| self.pnp.children(root))
            .unwrap_or_default();
        // Instance paths `...\dd.0` sort in function order; a later devnode
        // of the same path replaces the earlier.
        let newest: std::collections::BTreeMap<String, DevNodeId> = children
            .into_iter()
            .filter_map(|n| Some((self.pnp.instance_path(n)?, n)))
            .collect();
        newest.into_values().collect()
    }

    /// Plugs HCA `index` (its function number) in again after it was
    /// removed (orderly or by surprise): the PCI bus reports it, and the
    /// PnP manager enumerates a new devnode with the same instance path,
    /// which binds and starts as at boot. A function whose devnode is not
    /// removed yet (present, or surprise-removed with a handle still open)
    /// is left as it is. `STATUS_INVALID_PARAMETER` for a function the
    /// machine does not have, `STATUS_NO_SUCH_DEVICE` before boot.
    pub fn replug_hca(&self, index: usize) -> Result<(), NtStatus> {
        self.pci_bus.replug(index)?;
        self.pnp.process_bus_relations();
        Ok(())
    }

    /// Removes everything (query-remove of the root bus, or surprise
    /// removal if a driver vetoes), unloading every driver, so that the
    /// verifier sees every leak.
    pub fn shut_down(&self) {
        if let Some(root) = self.pnp.find(PCI_ROOT_INSTANCE)
            && self.pnp.query_and_remove(root).is_err()
        {
            self.pnp.surprise_remove(root);
        }
    }

    /// The violation log.
    pub fn verifier(&self) -> &Verifier {
        &self.verifier
    }

    /// The scheduler (run it in deterministic mode).
    pub fn scheduler(&self) -> &Scheduler {
        &self.sched
    }

    /// A handle for queuing DPCs, work items and timers.
    pub fn scheduler_handle(&self) -> SchedulerHandle {
        self.sched.handle()
    }

    /// The PnP (and power) manager.
    pub fn pnp(&self) -> &PnpManager {
        &self.pnp
    }

    /// The registry.
    pub fn registry(&self) -> &RegistryStore {
        &self.registry
    }

    /// Kernel pool.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The IOMMU.
    pub fn iommu(&self) -> &Iommu {
        &self.iommu
    }

    /// The HCAs and their fabric.
    pub fn backplane(&self) -> &Arc<Backplane> {
        &self.backplane
    }
}
