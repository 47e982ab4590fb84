//! The simulated Windows host in the main job: a machine with two HCAs
//! boots from our INF files, sleeps (S3), wakes and shuts down, under the
//! deterministic scheduler. The drivers are the host's stand-ins
//! (`sim_host::samples`), which log each D0 transition, so this shows the
//! platform's power ordering at work; `miniport_run` boots the same
//! machine with the real miniport.

use driver_platform::SystemPowerState;
use sim_hca::device::DeviceConfig;
use sim_host::host::{Host, HostConfig};
use sim_host::pnp::DevNodeId;
use sim_host::samples::register_stand_ins;

const SEED: u64 = 2026;

/// Boots, cycles power and shuts down; fails with what went wrong.
pub(crate) fn run() -> Result<(), String> {
    let hcas = vec![
        DeviceConfig::with_ports(0x0002_C900_0000_1000, &[[10, 0, 0, 1]]),
        DeviceConfig::with_ports(0x0002_C900_0000_2000, &[[10, 0, 0, 2]]),
    ];
    let host = Host::new(HostConfig::deterministic(SEED, hcas)).map_err(|e| e.to_string())?;
    let log = register_stand_ins(&host);
    let root = host.boot();
    let ran = host
        .scheduler()
        .run_until_idle(100_000)
        .map_err(|e| e.to_string())?;
    println!("\n== simulated Windows host (seed {SEED}) ==");
    println!("device tree, bound from inf/*.inf (stand-in drivers):");
    print_tree(&host, root, 1);
    println!("deferred items run during boot: {ran}");

    log.lock().map_err(|_| "stand-in log poisoned")?.clear();
    host.pnp()
        .set_system_power(SystemPowerState::S3)
        .map_err(|veto| veto.to_string())?;
    host.pnp()
        .set_system_power(SystemPowerState::S0)
        .map_err(|veto| veto.to_string())?;
    let steps: Vec<String> = log
        .lock()
        .map_err(|_| "stand-in log poisoned")?
        .iter()
        .filter(|l| l.contains(" D0 "))
        .cloned()
        .collect();
    let at = |what: String| {
        steps
            .iter()
            .position(|l| *l == what)
            .ok_or(format!("no {what:?} in {steps:?}"))
    };
    for hca in host.hcas() {
        for child in host.pnp().children(hca) {
            let down = at(format!("ibportclient {child:?} D0 exit"))?
                < at(format!("hcaminiport {hca:?} D0 exit"))?;
            let up = at(format!("hcaminiport {hca:?} D0 entry"))?
                < at(format!("ibportclient {child:?} D0 entry"))?;
            if !(down && up) {
                return Err(format!(
                    "power order broken between {hca:?} and {child:?}: {steps:?}"
                ));
            }
        }
    }
    println!(
        "S0 -> S3 -> S0: {} D0 transitions; each port client left D0 before its HCA and came back after it",
        steps.len()
    );
    host.shut_down();
    let violations = host.verifier().violations();
    println!(
        "shutdown: every driver unloaded; verifier: {} violation(s)",
        violations.len()
    );
    if violations.is_empty() {
        Ok(())
    } else {
        Err(violations
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; "))
    }
}

fn print_tree(host: &Host, node: DevNodeId, depth: usize) {
    let pnp = host.pnp();
    let stack: Vec<String> = pnp
        .stack_services(node)
        .into_iter()
        .map(|(service, role)| format!("{service} ({role:?})"))
        .collect();
    println!(
        "{:indent$}{}  [{}]  {:?}",
        "",
        pnp.instance_path(node).unwrap_or_default(),
        stack.join(" < "),
        pnp.state(node),
        indent = depth * 2
    );
    for child in pnp.children(node) {
        print_tree(host, child, depth + 1);
    }
}
