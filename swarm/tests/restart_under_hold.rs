//! Replay of a swarm defect (docs/swarm.md "What it found"): the PnP pass
//! that restarts a failed HCA settles the machine, and the other HCA was
//! holding its command completions (the `HoldCommands` fault), so virtual
//! time ran into that HCA's command timeout and the miniport failed it
//! too; the client never let go of it, and its removal found the client's
//! memory and AL interface references still held (`DmaLeak`,
//! `ReferenceLeak`). The swarm now ends a hold before the restart, as it
//! does before a sleep. Seed 213 at 600 steps fails at step 351 without
//! that.

use stack_swarm::{Config, Knobs, run};

// Heap calls the drivers make above DISPATCH_LEVEL are violations
// (docs/host-model.md, "Heap above DISPATCH_LEVEL").
sim_host::install_driver_heap_check!();

#[test]
fn a_restart_while_the_other_hca_holds_its_completions_runs_clean() {
    let config = Config {
        seed: 213,
        steps: 600,
        knobs: Knobs::default(),
        threaded: false,
    };
    let report = run(&config).unwrap_or_else(|failure| panic!("{failure}"));
    assert_eq!(
        report.ops.get("PnP restart of the failed HCA").copied(),
        Some(1),
        "{report:?}"
    );
}
