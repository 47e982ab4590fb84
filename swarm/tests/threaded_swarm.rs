//! A short swarm on the threaded host (`Config::threaded`, docs/swarm.md
//! "Threaded"): the DPCs that post and poll one QP and CQ run at once on
//! two worker threads, so the miniport's fast path and completion handling
//! really interleave. Not reproducible exactly, so it asserts only the
//! invariants that hold in any interleaving (the swarm checks them) and
//! that traffic flowed. Long runs: `cargo xtask swarm --threaded --seeds N`.

use stack_swarm::{Config, Knobs, run};

// Heap calls the drivers make above DISPATCH_LEVEL are violations
// (docs/host-model.md, "Heap above DISPATCH_LEVEL").
sim_host::install_driver_heap_check!();

/// Seeds and steps: well under a second of a debug build (most of it
/// real-time sleeps), with bounds of seconds for a loaded machine.
const SEEDS: std::ops::Range<u64> = 1..4;
const STEPS: usize = 150;

#[test]
fn short_threaded_swarm_runs_clean() {
    let mut completions = 0;
    for seed in SEEDS {
        let config = Config {
            seed,
            steps: STEPS,
            knobs: Knobs::default(),
            threaded: true,
        };
        match run(&config) {
            Ok(report) => {
                assert!(report.threaded, "seed {seed}: not on the threaded host");
                completions += report.completions;
            }
            Err(failure) => panic!("{failure}"),
        }
    }
    assert!(completions > 0, "nothing completed on the threaded host");
}
