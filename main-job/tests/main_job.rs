//! The main job's library entry point with small parameters (each run
//! takes under a second in a debug build): it passes and reports every
//! step; a deliberately broken step makes it fail and names that step,
//! with the machine still shut down and its verifier read; options it
//! cannot honour are refused before anything boots.

use stack_main_job::{Options, Report, Sabotage, run};

// The drivers' heap calls above DISPATCH_LEVEL are violations, as in the
// main job's binary.
sim_host::install_driver_heap_check!();

fn small() -> Options {
    Options {
        rounds: 4,
        user_rounds: 4,
        user_bytes: 1024,
        interactive: false,
        ..Options::default()
    }
}

fn explain(report: &Report) -> String {
    format!("{}{}", report.log, report.summary)
}

#[test]
fn the_main_job_passes_every_step_and_writes_its_capture() {
    let capture = std::env::temp_dir().join(format!("main-job-{}.pcap", std::process::id()));
    let report = run(&Options {
        capture: Some(capture.clone()),
        ..small()
    });
    assert!(report.success(), "{}", explain(&report));
    let names: Vec<&str> = report.steps.iter().map(|s| s.name).collect();
    assert_eq!(
        names,
        [
            "ABI contract",
            "boot",
            "kernel clients",
            "user application",
            "S3 with traffic in flight",
            "surprise removal",
            "re-plug",
            "shutdown"
        ]
    );
    assert_eq!(report.violations, Some(vec![]));
    let summary = &report.summary;
    assert!(summary.contains("SUCCESS"), "{summary}");
    assert!(
        summary.contains("verifier report: 0 violation(s)"),
        "{summary}"
    );
    // The tree has the port clients on the children; the power order
    // lists the children's exits before their HCA's.
    assert!(
        summary.contains("[ibalbus (Pdo) < ibportclient (Function)]"),
        "{summary}"
    );
    let order: Vec<&str> = summary
        .lines()
        .filter(|l| l.contains("sleep: D0 exit"))
        .collect();
    let first_hca = order.iter().position(|l| l.contains("hcaminiport"));
    let last_child = order.iter().rposition(|l| l.contains("ibportclient"));
    assert!(
        matches!((last_child, first_hca), (Some(c), Some(h)) if c < h),
        "{summary}"
    );
    // The three user applications (boot, survivor, after the re-plug)
    // moved 4 rounds of 5 checked operations each.
    assert_eq!(
        summary
            .matches("4 sends, 4 RDMA writes, 4 RDMA reads, 8 atomics")
            .count(),
        3
    );
    // The capture is a pcap of the frames the fabric carried.
    let bytes = std::fs::read(&capture).unwrap();
    let _ = std::fs::remove_file(&capture);
    let frames = sim_hca::pcap::PcapReader::new(&bytes)
        .unwrap()
        .filter(Result::is_ok)
        .count();
    assert!(frames > 100, "{frames} frames captured");
    assert!(
        summary.contains(&format!("frames on the fabric: {frames}")),
        "{summary}"
    );
}

/// The run failed at `step` with an error containing `why`, and still
/// shut the machine down cleanly.
fn assert_failed_at(report: &Report, step: &str, why: &str) {
    assert!(!report.success(), "{}", explain(report));
    let failed = report.failed_step().expect("a failed step");
    assert_eq!(failed.name, step, "{}", explain(report));
    let error = failed.outcome.as_ref().unwrap_err();
    assert!(error.contains(why), "{error}");
    assert!(report.summary.contains("FAILURE"), "{}", report.summary);
    assert_eq!(report.violations, Some(vec![]), "{}", explain(report));
}

#[test]
fn a_corrupted_rdma_read_fails_the_user_application_step() {
    let report = run(&Options {
        sabotage: Some(Sabotage::CorruptRead),
        ..small()
    });
    assert_failed_at(&report, "user application", "RDMA read round 0: byte 0");
}

#[test]
fn a_fabric_that_loses_every_frame_fails_the_user_application_step() {
    let report = run(&Options {
        sabotage: Some(Sabotage::DropFrames),
        ..small()
    });
    assert_failed_at(&report, "user application", "RetryExcErr");
}

#[test]
fn options_it_cannot_honour_are_refused_before_anything_boots() {
    for options in [
        Options { hcas: 1, ..small() },
        Options { hcas: 9, ..small() },
        Options {
            ports: 1,
            ..small()
        },
        Options {
            user_bytes: 0,
            ..small()
        },
    ] {
        let report = run(&options);
        assert!(!report.success());
        assert_eq!(report.failed_step().map(|s| s.name), Some("options"));
        assert_eq!(report.violations, None, "nothing booted");
    }
}

#[test]
fn three_and_five_hcas_pair_up_sleep_lose_one_and_get_it_back() {
    // An odd count: the last HCA's two ports pair with each other.
    for hcas in [3, 5] {
        let report = run(&Options { hcas, ..small() });
        assert!(report.success(), "{}", explain(&report));
        let pairs = 2 * (hcas / 2) + 1;
        assert!(
            report
                .log
                .contains(&format!("{pairs} pairs ran 4 checked rounds each")),
            "{}",
            explain(&report)
        );
        let last = hcas - 1;
        assert!(
            report.log.contains(&format!(
                "HCA {last} port 1 <-> HCA {last} port 2: initiator"
            )),
            "{}",
            explain(&report)
        );
        assert_eq!(report.violations, Some(vec![]));
    }
}

#[test]
fn an_odd_last_hca_with_an_odd_port_count_says_which_port_has_no_peer() {
    let report = run(&Options {
        hcas: 3,
        ports: 3,
        ..small()
    });
    assert!(report.success(), "{}", explain(&report));
    // HCAs 0 and 1 pair port by port (3 pairs), HCA 2's ports 1 and 2
    // pair with each other, and its port 3 is said to wait alone.
    assert!(
        report.log.contains("4 pairs ran 4 checked rounds each"),
        "{}",
        explain(&report)
    );
    assert!(
        report
            .log
            .contains("HCA 2 port 3: no peer (an odd last HCA with an odd port count); its client waits, Discovering"),
        "{}",
        explain(&report)
    );
    assert_eq!(report.violations, Some(vec![]));
}

/// Optimised code's kernel-stack use (`cargo test --release -p
/// stack-main-job`; a debug build inlines nothing and has its own budget):
/// after the whole job, every kind of routine left a sixth of the 24 KiB
/// budget free. When the miniport's verb dispatch inlined every verb's
/// handler into one 10.4 KiB frame, a request callback used 23.1 KiB.
#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "measures optimised code: cargo test --release -p stack-main-job"
)]
fn optimised_routines_leave_a_sixth_of_the_kernel_stack_free() {
    let report = run(&Options { hcas: 3, ..small() });
    assert!(report.success(), "{}", explain(&report));
    let limit = sim_host::stack::budget() * 5 / 6;
    for (kind, used) in sim_host::stack::high_water() {
        assert!(
            used <= limit,
            "{kind:?} used {used} bytes of stack, above {limit}"
        );
    }
}
