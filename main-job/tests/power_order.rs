//! The main job's power-order check (`tree::check_order`) on a machine
//! whose drivers are the host's stand-ins: the order the drivers saw at a
//! sleep and a wake passes; the same steps reversed (HCAs before their
//! children going down, after them coming up) are refused.

use driver_platform::SystemPowerState;
use sim_hca::device::DeviceConfig;
use sim_host::host::{Host, HostConfig};
use sim_host::pnp::PnpState;
use stack_main_job::tree::{PowerTrace, check_order};

#[test]
fn the_order_the_drivers_saw_passes_and_its_reverse_is_refused() {
    let hcas = vec![
        DeviceConfig::with_ports(0x0002_C900_0000_1000, &[[10, 0, 0, 1], [10, 0, 0, 2]]),
        DeviceConfig::with_ports(0x0002_C900_0000_2000, &[[10, 0, 1, 1], [10, 0, 1, 2]]),
    ];
    let host = Host::new(HostConfig::deterministic(5, hcas)).unwrap();
    let _log = sim_host::samples::register_stand_ins(&host);
    let trace = PowerTrace::attach(&host);
    host.boot();
    host.scheduler().run_until_idle(100_000).unwrap();
    let pnp = host.pnp();
    let families: Vec<_> = host
        .hcas()
        .into_iter()
        .map(|hca| {
            let children: Vec<_> = pnp
                .children(hca)
                .into_iter()
                .filter(|c| pnp.state(*c) == Some(PnpState::Started))
                .collect();
            (hca, children)
        })
        .collect();
    assert!(
        families.iter().all(|(_, c)| !c.is_empty()),
        "children per port"
    );
    trace.take();
    pnp.set_system_power(SystemPowerState::S3).unwrap();
    let down = trace.take();
    pnp.set_system_power(SystemPowerState::S0).unwrap();
    let up = trace.take();
    assert!(down.iter().all(|s| !s.entry) && up.iter().all(|s| s.entry));
    assert_eq!(check_order(&host, &down, &families, true), Ok(()));
    assert_eq!(check_order(&host, &up, &families, false), Ok(()));

    let reversed =
        |steps: &[sim_host::pnp::PowerStep]| steps.iter().rev().cloned().collect::<Vec<_>>();
    let err = check_order(&host, &reversed(&down), &families, true).unwrap_err();
    assert!(err.contains("did not leave D0 before its parent"), "{err}");
    let err = check_order(&host, &reversed(&up), &families, false).unwrap_err();
    assert!(err.contains("did not enter D0 after its parent"), "{err}");
    // A step missing is refused too: a child that never left D0.
    let without_children: Vec<_> = down
        .iter()
        .filter(|s| {
            families
                .iter()
                .all(|(hca, _)| s.node == *hca || !pnp.children(*hca).contains(&s.node))
        })
        .cloned()
        .collect();
    assert!(check_order(&host, &without_children, &families, true).is_err());
    host.shut_down();
    host.verifier().assert_clean();
}
