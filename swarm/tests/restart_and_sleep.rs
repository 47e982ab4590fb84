//! The swarm follows the PnP restart of a failed HCA and sleeps with
//! control requests in flight (docs/swarm.md): a seed whose mix has a
//! catastrophic error and sleep/resume runs clean, and its report shows
//! that the client let go of the failed HCA, took hold of the restarted
//! one (a new device and core on the same devnode) and moved data through
//! it, that the machine slept again after the failure, and that it slept
//! with requests outstanding (the miniport's power-managed queue lets D0
//! exit wait for them, or holds them until resume).

use stack_swarm::{Config, Knobs, run};

// Heap calls the drivers make above DISPATCH_LEVEL are violations
// (docs/host-model.md, "Heap above DISPATCH_LEVEL").
sim_host::install_driver_heap_check!();

fn count(report: &stack_swarm::Report, op: &str) -> u64 {
    report.ops.get(op).copied().unwrap_or(0)
}

#[test]
fn the_swarm_follows_a_restart_and_sleeps_with_requests_in_flight() {
    let config = Config {
        seed: 4,
        steps: 250,
        // The issue-9 mixes: the workload this seed was chosen for.
        knobs: Knobs::ISSUE_9,
        threaded: false,
    };
    let report = run(&config).unwrap_or_else(|failure| panic!("{failure}"));
    assert_eq!(count(&report, "fault: catastrophic"), 1, "{report:?}");
    assert_eq!(
        count(&report, "PnP restart of the failed HCA"),
        1,
        "{report:?}"
    );
    assert_eq!(
        count(&report, "PnP restart by the resume's pass"),
        1,
        "the machine slept with the failed HCA let go, and the resume restarted it: {report:?}"
    );
    assert!(
        count(&report, "successful completion on a restarted HCA") > 0,
        "the restarted HCA carried no traffic: {report:?}"
    );
    assert!(
        count(&report, "sleep after the catastrophic error") > 0,
        "{report:?}"
    );
    assert!(
        count(&report, "sleep with requests outstanding") > 0,
        "{report:?}"
    );
}
