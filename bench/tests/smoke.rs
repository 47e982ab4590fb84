//! The harness runs every measurement end to end with the least work (no
//! timing is asserted: the numbers of a debug build on a shared machine
//! mean nothing): each prints its lines, every value and baseline is a
//! positive finite number, every measured transfer was checked by the
//! measurement itself (it panics on a wrong byte or completion), and the
//! verifier found nothing on either machine.

use stack_bench::suite::{ALL, Effort, run};

#[test]
fn every_measurement_runs_and_reports_against_its_baseline() {
    let (lines, findings) = run(&ALL, Effort::smoke());
    assert!(findings.is_empty(), "verifier: {findings:#?}");
    let names: Vec<&str> = lines.iter().map(|l| l.name.as_str()).collect();
    for prefix in [
        "1 latency",
        "2 rate: 64 B RDMA write, 32/doorbell, 1 QP",
        "2 rate: 64 B RDMA write, 32/doorbell, 8 QP",
        "3 bandwidth",
        "5 control: CQ",
        "5 control: QP",
        "6 scale: create",
        "6 scale: post+poll",
    ] {
        assert!(
            names.iter().any(|n| n.starts_with(prefix)),
            "no line for {prefix:?} in {names:#?}"
        );
    }
    for line in &lines {
        assert!(line.value.is_finite() && line.value > 0.0, "{line}");
        if let Some(baseline) = line.baseline {
            assert!(baseline.is_finite() && baseline > 0.0, "{line}");
            assert!(line.ratio().is_some_and(f64::is_finite), "{line}");
        }
    }
    // The lines with a goal compare against a same-run baseline.
    assert!(
        lines
            .iter()
            .filter(|l| l.goal != stack_bench::report::Goal::None)
            .all(|l| l.baseline.is_some())
    );
}
