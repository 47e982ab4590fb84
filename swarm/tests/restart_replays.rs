//! Replays of swarm defects around the restart of a failed HCA
//! (docs/swarm.md "What it found").
//!
//! A restart under held completions: the PnP pass
//! that restarts a failed HCA settles the machine, and the other HCA was
//! holding its command completions (the `HoldCommands` fault), so virtual
//! time ran into that HCA's command timeout and the miniport failed it
//! too; the client never let go of it, and its removal found the client's
//! memory and AL interface references still held (`DmaLeak`,
//! `ReferenceLeak`). The swarm now ends a hold before the restart, as it
//! does before a sleep. Seed 213 at 600 steps fails at step 351 without
//! that.

//!
//! A UC QP left connected to the failed HCA: the client moved to ERR the
//! surviving HCA's RC/UC QPs whose partner died with the failure, but not
//! one whose partner had been destroyed before (the model no longer
//! linked them) and which was still in RTS, connected to that number. The
//! restarted core hands QP numbers out again at once (a new core has no
//! quiet period to keep), so the QP's next UC message landed in a
//! stranger's receive. Seed 184 at 600 steps with the issue-9 mixes fails
//! at step 387 without the fix ("receive on HCA 0 QP 0x3 ... holds
//! message 214 ... sent to HCA 0 QP 0x2").

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

#[test]
fn every_connected_qp_of_the_surviving_hca_goes_to_err_when_its_peer_fails() {
    let config = Config {
        seed: 184,
        steps: 600,
        // The issue-9 mixes: the workload this seed was found with.
        knobs: Knobs::ISSUE_9,
        threaded: false,
    };
    let report = run(&config).unwrap_or_else(|failure| panic!("{failure}"));
    assert_eq!(
        report.ops.get("PnP restart of the failed HCA").copied(),
        Some(1),
        "{report:?}"
    );
}
