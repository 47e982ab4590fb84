//! Scenario: a simulated machine with two HCAs boots from our INF files,
//! sleeps and wakes, and shuts down, with the Windows ordering rules
//! checked and the verifier clean — over several seeds. The drivers are
//! stand-ins that do what the real ones must at each PnP and power step
//! (map BAR0, take a DMA adapter, keep a common buffer, report the
//! static child from the registry); the miniport and the bus filter
//! replace them as they are built.

use std::sync::{Arc, Mutex};

use driver_platform::{
    ChildBus, ChildDescription, CommonBuffer, DevicePowerState, DmaAdapter, RegValue, Registry,
    RegistryKey, SystemPowerState,
};
use ib_types::status::NtStatus;
use sim_hca::device::DeviceConfig;
use sim_host::dma::{HostCommonBuffer, HostDmaAdapter};
use sim_host::driver::{
    DeviceCallbacks, DeviceInit, DriverEntry, SUCCESS, StackRole, UNSUCCESSFUL,
};
use sim_host::host::{Host, HostConfig};
use sim_host::pci::PciFunction;
use sim_host::pnp::{DeviceServices, PnpState};

type Log = Arc<Mutex<Vec<String>>>;

struct StandIn {
    service: &'static str,
    log: Log,
}

impl DriverEntry for StandIn {
    fn add_device(
        &self,
        init: &DeviceInit,
        host: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        Ok(Arc::new(Device {
            service: self.service,
            role: init.role,
            host: host.clone(),
            log: self.log.clone(),
            hardware: Mutex::new(None),
        }))
    }
}

struct Device {
    service: &'static str,
    role: StackRole,
    host: DeviceServices,
    log: Log,
    hardware: Mutex<Option<(Arc<PciFunction>, HostDmaAdapter, HostCommonBuffer)>>,
}

impl Device {
    fn note(&self, what: &str) {
        let path = self.host.node();
        self.log
            .lock()
            .unwrap()
            .push(format!("{} {path:?} {what}", self.service));
    }
}

impl DeviceCallbacks for Device {
    fn prepare_hardware(&self) -> NtStatus {
        match self.service {
            "hcaminiport" => {
                let Some(function) = self.host.resources::<PciFunction>() else {
                    return UNSUCCESSFUL;
                };
                if function.bar0().read32(hca_prm::regs::offset::MAGIC)
                    != hca_prm::regs::MAGIC_VALUE
                {
                    return UNSUCCESSFUL;
                }
                let adapter = match function.dma_adapter() {
                    Ok(a) => a,
                    Err(s) => return s,
                };
                let buffer = match adapter.alloc_common(4096) {
                    Ok(b) => b,
                    Err(s) => return s,
                };
                // The device can reach it; nothing else can.
                assert!(buffer.write(0, &[0xA5; 64]));
                *self.hardware.lock().unwrap() = Some((function, adapter, buffer));
            }
            "ibalbus" => {
                let Some(view) = self.host.registry() else {
                    return UNSUCCESSFUL;
                };
                let Some(RegValue::MultiString(children)) =
                    view.read(RegistryKey::ServiceParameters, "StaticChild")
                else {
                    return UNSUCCESSFUL;
                };
                for name in children {
                    let ids = |value: &str| match view
                        .read(RegistryKey::ServiceParameters, &format!("{name}\\{value}"))
                    {
                        Some(RegValue::MultiString(v)) => v,
                        _ => Vec::new(),
                    };
                    let child = ChildDescription {
                        instance_id: name.clone(),
                        hardware_ids: ids("HardwareId"),
                        compatible_ids: ids("CompatibleId"),
                        description: name.clone(),
                    };
                    if let Err(s) = self.host.report_present(child) {
                        return s;
                    }
                }
            }
            _ => {}
        }
        SUCCESS
    }

    fn release_hardware(&self) -> NtStatus {
        if let Some((function, adapter, buffer)) = self.hardware.lock().unwrap().take() {
            adapter.free_common(buffer);
            drop(function);
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
        (self.service == "ibalbus").then(|| Arc::new(ChildPdo) as Arc<dyn DeviceCallbacks>)
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

fn position(log: &[String], needle: &str) -> usize {
    log.iter()
        .position(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("{needle:?} not in {log:#?}"))
}

#[test]
fn a_two_hca_machine_boots_sleeps_wakes_and_shuts_down_cleanly() {
    for seed in [1, 7, 42] {
        let hcas = vec![
            DeviceConfig::with_ports(0x0002_C900_0000_1000, &[[10, 0, 0, 1]]),
            DeviceConfig::with_ports(0x0002_C900_0000_2000, &[[10, 0, 0, 2]]),
        ];
        let host = Host::new(HostConfig::deterministic(seed, hcas)).unwrap();
        let log: Log = Arc::default();
        for service in ["hcaminiport", "ibalbus", "ibportclient"] {
            host.register_driver(
                service,
                Arc::new(StandIn {
                    service,
                    log: log.clone(),
                }),
            );
        }
        host.boot();
        host.scheduler().run_until_idle(10_000).unwrap();
        let hcas = host.hcas();
        assert_eq!(hcas.len(), 2);
        for &hca in &hcas {
            assert_eq!(host.pnp().state(hca), Some(PnpState::Started));
            let children = host.pnp().children(hca);
            assert_eq!(children.len(), 1, "one port client per HCA");
            assert_eq!(host.pnp().state(children[0]), Some(PnpState::Started));
        }

        log.lock().unwrap().clear();
        host.pnp().set_system_power(SystemPowerState::S3).unwrap();
        host.pnp().set_system_power(SystemPowerState::S0).unwrap();
        let log = log.lock().unwrap().clone();
        for &hca in &hcas {
            let child = host.pnp().children(hca)[0];
            // Sleep: the child leaves D0 before its HCA; wake: the HCA
            // enters D0 before its child.
            assert!(
                position(&log, &format!("ibportclient {child:?} D0 exit"))
                    < position(&log, &format!("hcaminiport {hca:?} D0 exit"))
            );
            assert!(
                position(&log, &format!("hcaminiport {hca:?} D0 entry"))
                    < position(&log, &format!("ibportclient {child:?} D0 entry"))
            );
        }

        host.shut_down();
        for service in ["hcaminiport", "ibalbus", "ibportclient"] {
            assert!(!host.pnp().driver_loaded(service), "{service} unloaded");
        }
        assert_eq!(host.backplane().faults_before_adapter(), 0);
        host.verifier().assert_clean();
    }
}
