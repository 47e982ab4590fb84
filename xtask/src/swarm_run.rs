//! `cargo xtask swarm`: the swarm simulation of the whole stack
//! (`stack-swarm`, docs/swarm.md). One seed (`--seed S`) replays a run and
//! prints what it did; many (`--seeds N`, from `--first`) print progress
//! and, for each failure, its seed, diagnosis and replay command.
//!
//! `--threaded` runs the seeds on the threaded host (true concurrency, not
//! reproducible exactly). Long runs want an optimised build:
//! `cargo run --release -p xtask -- swarm --seeds 1000 --steps 2000`.

use std::process::ExitCode;

use stack_swarm::{Config, Knobs, Report};

/// The arguments of `cargo xtask swarm`.
#[derive(Debug, clap::Args)]
pub(crate) struct SwarmArgs {
    /// Replay this one seed (and print its report).
    #[arg(long, conflicts_with_all = ["seeds", "first"])]
    seed: Option<u64>,
    /// Run this many seeds.
    #[arg(long, default_value_t = 20)]
    seeds: u64,
    /// The first seed of a many-seed run.
    #[arg(long, default_value_t = 1)]
    first: u64,
    /// Workload steps per seed before the liveness phase.
    #[arg(long, default_value_t = 300)]
    steps: usize,
    /// Mixes to enable: a comma-separated list of reuse-unpolled,
    /// concurrent-polls, read-under-loss, cq-overflow, big-under-loss,
    /// inline-sends, al-clients, child-churn, user-opens, forged-handles,
    /// sleep-al-requests; `all` (the default) or `none`.
    #[arg(long, default_value = "all")]
    knobs: String,
    /// Run on the threaded host (DPCs on two OS threads, real time, no
    /// fabric faults): true concurrency inside the miniport, but a run
    /// does not replay exactly (docs/swarm.md "Threaded").
    #[arg(long)]
    threaded: bool,
}

pub(crate) fn run(args: &SwarmArgs) -> ExitCode {
    let knobs = match Knobs::parse(&args.knobs) {
        Ok(knobs) => knobs,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(seed) = args.seed {
        let config = Config {
            seed,
            steps: args.steps,
            knobs,
            threaded: args.threaded,
        };
        return match stack_swarm::run(&config) {
            Ok(report) => {
                print_report(&report, args.steps);
                ExitCode::SUCCESS
            }
            Err(failure) => {
                eprintln!("{failure}");
                ExitCode::FAILURE
            }
        };
    }
    println!(
        "swarm: seeds {}..{} x {} steps, knobs: {}{}",
        args.first,
        args.first.saturating_add(args.seeds),
        args.steps,
        knobs.list(),
        if args.threaded {
            " (threaded host: not reproducible exactly)"
        } else {
            ""
        }
    );
    let summary = stack_swarm::run_many(
        args.first,
        args.seeds,
        args.steps,
        knobs,
        args.threaded,
        |s, outcome| {
            if let Err(failure) = outcome {
                eprintln!("{failure}");
            }
            let done = s.clean + s.failures.len() as u64;
            if done.is_multiple_of(10) || outcome.is_err() || done == args.seeds {
                println!(
                    "[{done}/{}] {} clean, {} failed, {} steps, {} completions checked, {:.1?}",
                    args.seeds,
                    s.clean,
                    s.failures.len(),
                    s.steps,
                    s.completions,
                    s.wall
                );
            }
        },
    );
    let per_step = summary.wall.as_secs_f64() * 1e6 / summary.steps.max(1) as f64;
    println!(
        "swarm: {} clean, {} failed; {} steps, {} completions and {} payload bytes checked in {:.1?} ({per_step:.0} us per step)",
        summary.clean,
        summary.failures.len(),
        summary.steps,
        summary.completions,
        summary.bytes_checked,
        summary.wall
    );
    let coverage: Vec<String> = summary
        .ops
        .iter()
        .filter(|(op, _)| {
            [
                "fault:",
                "PnP",
                "sleep",
                "successful completion on a restarted",
                "AL ",
                "child entry",
                "user ",
                "forged",
                "rereg",
            ]
            .iter()
            .any(|prefix| op.starts_with(prefix))
        })
        .map(|(op, n)| format!("{op}: {n}"))
        .collect();
    if !coverage.is_empty() {
        println!("  {}", coverage.join(", "));
    }
    if args.threaded {
        println!(
            "  {} of the swarm's DPCs started while another was running",
            summary.overlapping_dpcs
        );
    }
    for failure in &summary.failures {
        println!(
            "  seed {}: {} -> {}",
            failure.config.seed,
            failure.message.lines().next().unwrap_or(""),
            failure.replay()
        );
    }
    if summary.failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn print_report(report: &Report, steps: usize) {
    println!(
        "swarm seed {}: clean after {steps} steps and the liveness phase{}",
        report.seed,
        if report.threaded {
            " on the threaded host (its interleaving is not reproducible)"
        } else {
            ""
        }
    );
    println!("  mix: {}", report.mix);
    for (op, n) in &report.ops {
        println!("  {op}: {n}");
    }
    println!(
        "  {} completions checked ({:?}), {} payload bytes compared, {} async events",
        report.completions, report.statuses, report.bytes_checked, report.async_events
    );
    println!(
        "  {} frames on the fabric; {:.3} s of {} time in {:.1?} of wall time",
        report.frames,
        report.virtual_ns as f64 / 1e9,
        if report.threaded { "real" } else { "virtual" },
        report.wall
    );
    if report.threaded {
        println!(
            "  {} of the swarm's DPCs started while another was running",
            report.overlapping_dpcs
        );
    }
}
