//! Replays of the seeds that once failed the CQ-room model (docs/swarm.md,
//! "What it found"): a `DestroyQp` held back (the `HoldCommands` fault) completed
//! while the swarm waited for a later `ResizeCq` (seed 323) or `CreateQp`
//! (seed 597), so the miniport had given the QP's share back, but the model
//! judged the later request before applying the destroy. Each run is the
//! seed's failing prefix (a seed's run depends on its step count too).

use stack_swarm::{Config, Knobs, run};

// Heap calls the drivers make above DISPATCH_LEVEL are violations
// (docs/host-model.md, "Heap above DISPATCH_LEVEL").
sim_host::install_driver_heap_check!();

fn replay(seed: u64, steps: usize) {
    let config = Config {
        seed,
        steps,
        // The issue-9 mixes: the workload this seed was chosen for.
        knobs: Knobs::ISSUE_9,
        threaded: false,
    };
    if let Err(failure) = run(&config) {
        panic!("{failure}");
    }
}

/// Resize to 1 entry answered after a held destroy freed the CQ's last
/// committed entries: success is right.
#[test]
fn resize_after_a_held_destroy_completed_is_judged_with_its_room_back() {
    replay(323, 100);
}

/// A QP created after a held destroy freed room in its CQ: acceptance is
/// right.
#[test]
fn create_after_a_held_destroy_completed_is_judged_with_its_room_back() {
    replay(597, 200);
}
