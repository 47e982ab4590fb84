//! The short swarm of the default suite: a few seeds of the whole stack
//! (two HCAs, fabric faults, the real miniport through its CI interface,
//! the seeded host scheduler) with every knob on (`Knobs::ALL`, the
//! default; docs/swarm.md). Long runs: `cargo xtask swarm --seeds N --steps M`.

use stack_swarm::{Config, Knobs, run};

// Heap calls the drivers make above DISPATCH_LEVEL are violations
// (docs/host-model.md, "Heap above DISPATCH_LEVEL").
sim_host::install_driver_heap_check!();

/// Seeds and steps of the default suite: a few seconds in a debug build.
const SEEDS: std::ops::Range<u64> = 1..9;
const STEPS: usize = 200;

#[test]
fn short_swarm_runs_clean() {
    for seed in SEEDS {
        let config = Config {
            seed,
            steps: STEPS,
            knobs: Knobs::default(),
            threaded: false,
        };
        match run(&config) {
            Ok(report) => {
                assert!(
                    report.completions > 0,
                    "seed {seed}: nothing completed: {report:?}"
                );
            }
            Err(failure) => panic!("{failure}"),
        }
    }
}
