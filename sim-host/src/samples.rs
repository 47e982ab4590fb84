//! Stand-in drivers under the service names our INFs install
//! (`hcaminiport`, `ibalbus`, `ibportclient`), for tests of the host
//! itself (the power order is checked from their log) and, for the bus
//! filter and the port client, for scenario tests until the real drivers
//! exist. The real miniport is `sim_shells::hca_miniport`, registered over the
//! `hcaminiport` stand-in where a scenario runs it; the real bus filter,
//! `sim_shells::ibal_bus`, likewise over `ibalbus`. Each does, at each PnP
//! and power step, the minimum the real driver must, and logs it:
//!
//! - `hcaminiport` (function driver of the HCA): finds its `PciFunction`,
//!   checks BAR0's magic, takes the DMA adapter and keeps one common buffer
//!   the device can reach; frees it on release.
//! - `ibalbus` (upper filter on the HCA): reports the static children its
//!   INF listed under its service key (`StaticChild`, and per child
//!   `HardwareId`, `CompatibleId`, `PartitionKey`), and creates their PDOs.
//! - `ibportclient` (function driver of a port child): reads its device
//!   key's `ReceiveDepth`.
//!
//! Log lines are `"<service> <devnode> <what>"`.

use std::sync::{Arc, Mutex};

use driver_platform::{
    ChildBus, ChildDescription, CommonBuffer, DevicePowerState, DmaAdapter, Mmio, RegValue,
    Registry, RegistryKey,
};
use ib_types::status::NtStatus;

use crate::dma::{HostCommonBuffer, HostDmaAdapter};
use crate::driver::{DeviceCallbacks, DeviceInit, DriverEntry, SUCCESS, StackRole, UNSUCCESSFUL};
use crate::host::Host;
use crate::pci::PciFunction;
use crate::pnp::DeviceServices;

/// What the stand-ins did, in order.
pub type Log = Arc<Mutex<Vec<String>>>;

/// The services the stand-ins cover.
pub const STAND_IN_SERVICES: [&str; 3] = ["hcaminiport", "ibalbus", "ibportclient"];

/// Registers every stand-in on `host`; returns their shared log.
pub fn register_stand_ins(host: &Host) -> Log {
    let log = Log::default();
    for service in STAND_IN_SERVICES {
        host.register_driver(
            service,
            Arc::new(StandIn {
                service,
                log: log.clone(),
            }),
        );
    }
    log
}

/// One stand-in driver.
#[derive(Debug)]
pub struct StandIn {
    service: &'static str,
    log: Log,
}

impl DriverEntry for StandIn {
    fn add_device(
        &self,
        init: &DeviceInit,
        host: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        Ok(Arc::new(StandInDevice {
            service: self.service,
            role: init.role,
            host: host.clone(),
            log: self.log.clone(),
            hardware: Mutex::new(None),
        }))
    }
}

struct StandInDevice {
    service: &'static str,
    role: StackRole,
    host: DeviceServices,
    log: Log,
    hardware: Mutex<Option<(HostDmaAdapter, HostCommonBuffer)>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn strings(view: &dyn Registry, name: &str) -> Vec<String> {
    match view.read(RegistryKey::ServiceParameters, name) {
        Some(RegValue::MultiString(v)) => v,
        Some(RegValue::String(s)) => vec![s],
        _ => Vec::new(),
    }
}

impl StandInDevice {
    fn note(&self, what: impl std::fmt::Display) {
        let node = self.host.node();
        lock(&self.log).push(format!("{} {node:?} {what}", self.service));
    }

    fn start_miniport(&self) -> Result<(), NtStatus> {
        let function = self.host.resources::<PciFunction>().ok_or(UNSUCCESSFUL)?;
        let magic = function.bar0().read32(hca_prm::regs::offset::MAGIC);
        self.note(format_args!("magic {magic:#x}"));
        if magic != hca_prm::regs::MAGIC_VALUE {
            return Err(UNSUCCESSFUL);
        }
        let adapter = function.dma_adapter()?;
        let buffer = adapter.alloc_common(4096)?;
        if !buffer.write(0, &[0xA5; 64]) {
            adapter.free_common(buffer);
            return Err(UNSUCCESSFUL);
        }
        *lock(&self.hardware) = Some((adapter, buffer));
        Ok(())
    }

    fn start_bus_filter(&self) -> Result<(), NtStatus> {
        let view = self.host.registry().ok_or(UNSUCCESSFUL)?;
        for name in strings(&view, "StaticChild") {
            let pkey = view.read_dword(
                RegistryKey::ServiceParameters,
                &format!("{name}\\PartitionKey"),
            );
            self.note(format_args!("child {name} pkey {pkey:x?}"));
            self.host.report_present(ChildDescription {
                hardware_ids: strings(&view, &format!("{name}\\HardwareId")),
                compatible_ids: strings(&view, &format!("{name}\\CompatibleId")),
                description: name.clone(),
                instance_id: name,
            })?;
        }
        Ok(())
    }

    fn start_port_client(&self) -> Result<(), NtStatus> {
        let view = self.host.registry().ok_or(UNSUCCESSFUL)?;
        let depth = view.read_dword(RegistryKey::Device, "ReceiveDepth");
        self.note(format_args!("receive depth {depth:?}"));
        Ok(())
    }
}

impl DeviceCallbacks for StandInDevice {
    fn prepare_hardware(&self) -> NtStatus {
        self.note("start");
        let started = match self.service {
            "hcaminiport" => self.start_miniport(),
            "ibalbus" => self.start_bus_filter(),
            "ibportclient" => self.start_port_client(),
            _ => Ok(()),
        };
        started.err().unwrap_or(SUCCESS)
    }

    fn release_hardware(&self) -> NtStatus {
        if let Some((adapter, buffer)) = lock(&self.hardware).take() {
            adapter.free_common(buffer);
        }
        SUCCESS
    }

    fn d0_entry(&self, _from: DevicePowerState) -> NtStatus {
        self.note("D0 entry");
        SUCCESS
    }

    fn d0_exit(&self, _to: DevicePowerState) -> NtStatus {
        self.note("D0 exit");
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

/// The PDO of a port child: its queue is power-managed, KMDF's default
/// for a PDO.
struct ChildPdo;

impl DeviceCallbacks for ChildPdo {}
