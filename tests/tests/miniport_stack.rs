//! Scenario: the main job's machine with the real miniport and the real
//! bus filter, over several seeds — two HCAs bound from `inf/`, the AL
//! interface obtained from each HCA's port-1 child by
//! `IRP_MN_QUERY_INTERFACE`, PD/CQ/QP/AV created and memory registered
//! (`RegPhysMr`) through its synchronous helper, RC sends both ways, an
//! RDMA write and read, and a UD datagram through an AV handle moved
//! through its direct calls with every byte checked, completion events at
//! DISPATCH_LEVEL; S3 and back with every object alive (UD traffic again,
//! the RC pair back in ERR with `QpFatal`, reconnected, traffic again, all
//! checked), teardown, shutdown with an empty verifier report. The
//! scenario is `miniport_stack/run.rs` (the main job's kernel client until
//! the main job ran the real port client, `main-job/`).

#[path = "miniport_stack/run.rs"]
mod miniport_run;

// Heap calls the drivers make above DISPATCH_LEVEL are violations
// (docs/host-model.md, "Heap above DISPATCH_LEVEL").
sim_host::install_driver_heap_check!();

#[test]
fn rc_and_ud_traffic_through_the_real_miniport_then_sleep_wake_and_a_clean_shutdown() {
    for seed in [1, 7, 42, miniport_run::SEED] {
        let summary = miniport_run::run(seed).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        // Before sleep: 4 sends of 1 + 100 + 1024 + 4000 bytes each way,
        // 3000 bytes written and read back, a 900-byte datagram; after
        // resume: another datagram, and the sends again over the
        // reconnected RC pair.
        assert_eq!(
            summary.bytes_checked,
            2 * 5125 + 2 * 3000 + 900 + 900 + 2 * 5125,
            "seed {seed}"
        );
        // 8 sends and 8 receives, the write and the read, the datagram's
        // send and receive; after resume 2 for the datagram and 16 for the
        // sends.
        assert_eq!(summary.completions, 20 + 2 + 16, "seed {seed}");
        // Every reap that found completions was preceded by the event it
        // armed for: at least one per reap with work (7 before the sleep,
        // 6 after it).
        assert!(summary.completion_events >= 13, "seed {seed}: {summary:?}");
        assert!(summary.restarted_after_wake, "seed {seed}");
        let report = miniport_run::render(seed, &summary);
        assert!(report.contains("verifier: 0 violation(s)"), "{report}");
        let stacks = summary
            .lines
            .iter()
            .filter(|l| l.contains("[pci (Pdo) < hcaminiport (Function) < ibalbus (UpperFilter)]"))
            .count();
        assert_eq!(
            stacks, 2,
            "both HCAs bound to the miniport from inf/: {report}"
        );
    }
}
