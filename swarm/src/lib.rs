//! Swarm simulation of the whole stack (issue 9; docs/swarm.md), in the
//! manner of TigerBeetle's VOPR and FoundationDB's simulation: one seed
//! drives the simulated HCAs and their fabric, the simulated host's
//! deterministic scheduler (virtual time, seeded interleaving of DPCs,
//! work items, timers and the device stepper) and a workload that issues
//! random verbs through the real bus filter's access layer (an AL client
//! on each HCA's port-1 child) to the real miniport, while faults
//! drawn from the same seed hit it: packet loss, duplication, reordering
//! and corruption, link flaps, QPs forced to ERR, a catastrophic error,
//! sleep and resume, command completions held back. Each seed also draws
//! which operations and faults are enabled and how often (swarm testing).
//!
//! Invariants are checked after every step (see `workload`), then a
//! liveness phase with the faults off requires everything to drain within
//! a bound, then teardown requires a clean verifier. A failure names its
//! seed and the command that replays it.
//!
//! With [`Config::threaded`] the same seed's workload runs on sim-host's
//! threaded host instead (DPCs on two OS threads, real time, no fabric
//! faults): true concurrency inside the miniport, at the price of exact
//! replay (docs/swarm.md "Threaded").
//!
//! Beside that client, the actors of issue 11 (extra AL clients opening
//! and closing with live objects, children added and removed at runtime,
//! user processes opening HCAs through the proxy and dying, handles
//! forged across opens, AL requests in flight across a sleep).
//!
//! [`Knobs`] switch the verb and fault mixes that reached the defects of
//! issue 9 and the issue-11 actors (all on by default); [`run`] with the
//! default knobs is what the default test suite runs.

mod machine;
mod mix;
mod workload;

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, Instant};

pub use mix::Knobs;

/// One swarm run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// Drives everything: the machine, the fabric, the scheduler, the mix,
    /// the workload and the faults.
    pub seed: u64,
    /// Workload steps before the liveness phase.
    pub steps: usize,
    /// Which known-defect mixes are allowed.
    pub knobs: Knobs,
    /// Run on sim-host's threaded host (DPCs on two OS threads, real
    /// time, lossless fabric) instead of the deterministic one: the seed
    /// draws the same mix and workload, but the interleaving is the
    /// machine's, so a run does not replay exactly (docs/swarm.md).
    pub threaded: bool,
}

/// What a clean run did.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// The seed.
    pub seed: u64,
    /// The seed's mix, described.
    pub mix: String,
    /// Operations run, by name.
    pub ops: BTreeMap<&'static str, u64>,
    /// Work completions polled and checked.
    pub completions: u64,
    /// Completions by status.
    pub statuses: BTreeMap<String, u64>,
    /// Payload bytes compared byte for byte.
    pub bytes_checked: u64,
    /// Asynchronous events the clients received.
    pub async_events: u64,
    /// Frames the HCAs put on the fabric (retransmission storms show
    /// here before they become a failure).
    pub frames: u64,
    /// Virtual time at the end of the liveness phase (threaded: real
    /// time since the host started).
    pub virtual_ns: u64,
    /// Whether it ran on the threaded host (not reproducible exactly).
    pub threaded: bool,
    /// The swarm's DPCs that started while another of its DPCs was
    /// running (threaded host; always 0 on the deterministic one).
    pub overlapping_dpcs: u64,
    /// Wall-clock time of the run.
    pub wall: Duration,
}

/// A failed run: where, what, and how to replay it.
#[derive(Debug, Clone)]
pub struct Failure {
    /// The run's configuration.
    pub config: Config,
    /// The step that failed (`steps` + 1 for the liveness phase and
    /// teardown, 0 for boot).
    pub step: usize,
    /// What broke.
    pub message: String,
    /// The seed's mix.
    pub mix: String,
    /// The last operations before the failure.
    pub trace: Vec<String>,
}

impl Failure {
    /// The one command that replays this run.
    pub fn replay(&self) -> String {
        replay_command(&self.config)
    }
}

/// The command that replays `config`.
pub fn replay_command(config: &Config) -> String {
    let knobs = if config.knobs == Knobs::default() {
        String::new()
    } else {
        format!(" --knobs {}", config.knobs.list())
    };
    let threaded = if config.threaded { " --threaded" } else { "" };
    format!(
        "cargo xtask swarm --seed {} --steps {}{knobs}{threaded}",
        config.seed, config.steps
    )
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "swarm seed {} failed at step {} of {}{}: {}",
            self.config.seed,
            self.step,
            self.config.steps,
            if self.config.threaded {
                " (threaded host: the interleaving is not reproducible; the replay draws the same workload)"
            } else {
                ""
            },
            self.message
        )?;
        writeln!(f, "  mix: {}", self.mix)?;
        for line in &self.trace {
            writeln!(f, "  {line}")?;
        }
        write!(f, "  replay: {}", self.replay())
    }
}

/// Runs one seed: boot, `steps` workload steps with invariants checked
/// after each, the liveness phase, teardown. A panic anywhere (in the
/// stack or the swarm) is a failure too.
pub fn run(config: &Config) -> Result<Report, Failure> {
    let started = Instant::now();
    let mut at = (0, String::new(), Vec::new());
    let outcome =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_inner(config, &mut at)));
    let (step, mix, trace) = at;
    let fail = |message: String| Failure {
        config: *config,
        step,
        message,
        mix: mix.clone(),
        trace: trace.clone(),
    };
    match outcome {
        Ok(Ok(mut report)) => {
            report.wall = started.elapsed();
            Ok(report)
        }
        Ok(Err(message)) => Err(fail(message)),
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_else(|| "a panic".to_owned());
            Err(fail(format!("panicked: {what}")))
        }
    }
}

/// The run; `at` keeps the step, mix and trace for a failure report
/// (also when it panics).
fn run_inner(config: &Config, at: &mut (usize, String, Vec<String>)) -> Result<Report, String> {
    let mut swarm = workload::Swarm::new(config.seed, config.knobs, config.steps, config.threaded)?;
    at.1 = swarm.report.mix.clone();
    for step in 1..=config.steps {
        at.0 = step;
        let outcome = swarm.step(step);
        at.2 = swarm.trace.clone();
        outcome?;
    }
    at.0 = config.steps + 1;
    let outcome = swarm.liveness();
    at.2 = swarm.trace.clone();
    outcome?;
    swarm.teardown()
}

/// The outcome of many seeds.
#[derive(Debug, Default)]
pub struct Summary {
    /// Seeds that ran clean.
    pub clean: u64,
    /// Seeds that failed.
    pub failures: Vec<Failure>,
    /// Steps run over all seeds.
    pub steps: u64,
    /// Completions checked over all seeds.
    pub completions: u64,
    /// Payload bytes checked over all seeds.
    pub bytes_checked: u64,
    /// DPCs of the swarm that ran while another did, over all seeds
    /// (threaded host).
    pub overlapping_dpcs: u64,
    /// Operations run by the clean seeds, by name (faults, restarts and
    /// sleeps show how much of the mix the seeds reached).
    pub ops: BTreeMap<&'static str, u64>,
    /// Wall-clock time.
    pub wall: Duration,
}

/// Runs seeds `first..first + count`, each for `steps` steps, calling
/// `progress` after each.
pub fn run_many(
    first: u64,
    count: u64,
    steps: usize,
    knobs: Knobs,
    threaded: bool,
    mut progress: impl FnMut(&Summary, &Result<Report, Failure>),
) -> Summary {
    let started = Instant::now();
    let mut summary = Summary::default();
    for seed in first..first.saturating_add(count) {
        let outcome = run(&Config {
            seed,
            steps,
            knobs,
            threaded,
        });
        match &outcome {
            Ok(report) => {
                summary.clean += 1;
                summary.steps += steps as u64;
                summary.completions += report.completions;
                summary.bytes_checked += report.bytes_checked;
                summary.overlapping_dpcs += report.overlapping_dpcs;
                for (op, n) in &report.ops {
                    *summary.ops.entry(op).or_default() += n;
                }
            }
            Err(failure) => {
                summary.steps += failure.step.min(steps) as u64;
                summary.failures.push(failure.clone());
            }
        }
        summary.wall = started.elapsed();
        progress(&summary, &outcome);
    }
    summary
}
