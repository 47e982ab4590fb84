//! Scenario: a simulated machine with two HCAs boots from our INF files,
//! sleeps and wakes, and shuts down, with the Windows ordering rules
//! checked and the verifier clean — over several seeds. The drivers are
//! the host's stand-ins (`sim_host::samples`), which do what the real ones
//! must at each PnP and power step (map BAR0, take a DMA adapter, keep a
//! common buffer, report the static child from the registry); the
//! miniport and the bus filter replace them as they are built.

use driver_platform::SystemPowerState;
use sim_hca::device::DeviceConfig;
use sim_host::host::{Host, HostConfig};
use sim_host::pnp::PnpState;
use sim_host::samples::{STAND_IN_SERVICES, register_stand_ins};

// Heap calls the drivers make above DISPATCH_LEVEL are violations
// (docs/host-model.md, "Heap above DISPATCH_LEVEL").
sim_host::install_driver_heap_check!();

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
        let log = register_stand_ins(&host);
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
        for service in STAND_IN_SERVICES {
            assert!(!host.pnp().driver_loaded(service), "{service} unloaded");
        }
        assert_eq!(host.backplane().faults_before_adapter(), 0);
        host.verifier().assert_clean();
    }
}
