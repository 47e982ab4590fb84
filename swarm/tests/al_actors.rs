//! The issue-11 actors of the swarm (docs/swarm.md "AL clients, children
//! and user opens"), every knob on: a seed whose run has them all runs
//! clean, and its report shows that extra AL clients closed with live
//! objects (the AL destroyed them: the miniport gave their CQ and QP rings
//! back, no orphan left, the client's driver-object reference released, no
//! callback after the close returned), that an extra client's QP in ERR
//! flushed its receives to it exactly once, that user processes created
//! objects through the proxy and died leaving nothing locked, mapped or
//! alive, that child-list entries came and went, that forged handles were
//! refused, that the machine slept with AL requests in flight (each
//! completed once), and that an HCA failed and was restarted meanwhile.

use stack_swarm::{Config, Knobs, run};

// Heap calls the drivers make above DISPATCH_LEVEL are violations
// (docs/host-model.md, "Heap above DISPATCH_LEVEL").
sim_host::install_driver_heap_check!();

fn count(report: &stack_swarm::Report, op: &str) -> u64 {
    report.ops.get(op).copied().unwrap_or(0)
}

#[test]
fn al_clients_children_user_opens_and_forged_handles_run_clean() {
    let config = Config {
        seed: 59,
        steps: 250,
        knobs: Knobs::default(),
        threaded: false,
    };
    let report = run(&config).unwrap_or_else(|failure| panic!("{failure}"));
    for op in [
        "AL client closed with live objects",
        "AL client rings checked given back at close",
        "AL client QP flushed",
        "AL client callbacks before close",
        "user object created",
        "user process died",
        "child entry added",
        "child entry removed",
        "forged handle refused",
        "sleep with AL requests in flight",
        "AL request completed across a sleep",
        "PnP restart of the failed HCA",
    ] {
        assert!(count(&report, op) > 0, "no {op:?}: {report:?}");
    }
}
