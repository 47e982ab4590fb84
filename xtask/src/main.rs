//! Project automation, run as `cargo xtask <command>` (a cargo alias).
//!
//! - `run [--hcas N] [--ports N] [--seed S] [--capture FILE] [-- ...]`:
//!   the main job (`main-job/`, README "Quick start"). It is built and run
//!   optimised: this re-invokes `cargo run --release --locked -p
//!   stack-main-job`, so xtask itself stays a quick debug build for CI.
//! - `test`: the test suite, exactly what CI runs after its lint gates:
//!   the workspace tests, the main job's tests optimised, perftest's
//!   defaults on our libraries optimised, the loom models.
//! - `capture --out FILE`: runs the simulated HCA's scripted traffic mix and
//!   writes its pcap capture (open it in Wireshark).
//! - `inf-lint`: checks `inf/*.inf` against the InfVerif rules checkable
//!   here (`inf_lint`, `docs/inf-lint.md`).
//! - `wdk-check`: type-checks and lints the KMDF shells for the Windows
//!   target against a stand-in WDK (`wdk_check`).
//! - `swarm [--seed S | --seeds N] [--steps M] [--knobs ...]`: the swarm
//!   simulation of the whole stack (`swarm_run`, docs/swarm.md).
//! - `fuzz <target> [--seconds N]` / `fuzz --all`: runs cargo-fuzz targets
//!   (`fuzz`; README "Fuzzing").
//! - `bench-insn [WORKLOAD]`: instructions per post_send and per polled
//!   CQE, driver, plugin and our libibverbs (`compat`), under callgrind (`bench_insn`; issue 13,
//!   measurement 4, docs/performance.md).
//! - `bench [--only 1,2,3,5,6] [--quick]`: the benchmarks against same-run
//!   baselines, optimised (`bench`, docs/performance.md).
//! - `verbs-libs [--out DIR] [--release]`: builds our `libibverbs.so.1`
//!   and the side libraries perftest links and lays them out under their
//!   sonames (`verbs_libs`, docs/libibverbs.md).

mod bench;
mod bench_insn;
mod fuzz;
mod inf_lint;
mod swarm_run;
mod verbs_libs;
mod wdk_check;

use std::process::{Command, ExitCode};

use clap::{Parser, Subcommand};

// The main job boots drivers: heap calls they make above DISPATCH_LEVEL
// are violations (docs/host-model.md, "Heap above DISPATCH_LEVEL").
sim_host::install_driver_heap_check!();

#[derive(Debug, Parser)]
#[command(about = "Project automation for the InfiniBand stack")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// The main job, built and run optimised: the whole stack on the
    /// simulated Windows host (README "Quick start").
    Run(MainJobArgs),
    /// Model-check the cores' lock-free protocols with loom (extra
    /// arguments go to the test binary, e.g. a test-name filter).
    Loom {
        /// Passed through to the test binary.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Run the scripted RoCEv2 traffic mix and write its pcap capture.
    Capture {
        /// Where to write the capture.
        #[arg(long)]
        out: std::path::PathBuf,
        /// Seed of the simulation (the capture is reproducible from it).
        #[arg(long, default_value_t = 7)]
        seed: u64,
    },
    /// Check `inf/*.inf` against the InfVerif rules checkable here.
    InfLint,
    /// Type-check and lint (`-D warnings`) every KMDF shell for
    /// x86_64-pc-windows-msvc against a stand-in WDK (see wdk_check.rs).
    WdkCheck {
        /// Microsoft's KMDF 1.33 headers (default: $WDK_CHECK_KMDF_HEADERS,
        /// else the project machines' copy).
        #[arg(long)]
        kmdf_headers: Option<std::path::PathBuf>,
    },
    /// Swarm simulation of the whole stack (docs/swarm.md).
    Swarm(swarm_run::SwarmArgs),
    /// Run a cargo-fuzz target of `fuzz/` for a while (needs
    /// `cargo install cargo-fuzz`).
    Fuzz {
        /// The target (`cargo fuzz list`).
        target: Option<String>,
        /// Run every target in turn.
        #[arg(long, conflicts_with = "target")]
        all: bool,
        /// Seconds per target.
        #[arg(long, default_value_t = 120)]
        seconds: u64,
    },
    /// Instructions per post_send and per polled CQE (callgrind).
    BenchInsn {
        /// Only the workloads whose name contains this (e.g. `driver`).
        workload: Option<String>,
    },
    /// Benchmarks against baselines measured in the same run, built
    /// optimised (docs/performance.md).
    Bench {
        /// Measurements to run, comma-separated (1 latency, 2 message
        /// rate, 3 bandwidth, 5 control path, 6 scale); all by default.
        #[arg(long, value_delimiter = ',')]
        only: Vec<u8>,
        /// Few repetitions and small counts: checks the harness quickly.
        #[arg(long)]
        quick: bool,
    },
    /// Build our libibverbs.so.1 and the side libraries perftest links
    /// (libmlx5.so.1, libefa.so.1, librdmacm.so.1, libibumad.so.3) into one
    /// directory under their sonames, check ib_send_bw loads them and
    /// ibv_devinfo runs on them (docs/libibverbs.md).
    VerbsLibs {
        /// The directory (default: target/verbs-libs).
        #[arg(long)]
        out: Option<std::path::PathBuf>,
        /// Build them optimised.
        #[arg(long)]
        release: bool,
    },
    /// Run the workspace tests (extra arguments go to `cargo test`), then the
    /// main job's tests built optimised, then perftest's defaults on our
    /// libraries built optimised, then the loom models.
    Test {
        /// Passed through to `cargo test`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

/// The main job's options (`main-job --help` lists them all).
#[derive(Debug, clap::Args)]
struct MainJobArgs {
    /// HCAs on the PCI bus.
    #[arg(long, default_value_t = 2)]
    hcas: usize,
    /// Ports per HCA.
    #[arg(long, default_value_t = 2)]
    ports: u8,
    /// Seed of the simulation: the run is reproducible from it.
    #[arg(long, default_value_t = 2026)]
    seed: u64,
    /// Write a pcap capture of the fabric's frames.
    #[arg(long)]
    capture: Option<std::path::PathBuf>,
    /// More options for `main-job` (after `--`).
    #[arg(last = true)]
    extra: Vec<String>,
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Cmd::Run(args) => main_job(&args),
        Cmd::Test { args } => {
            let workspace = test(&args);
            if workspace != ExitCode::SUCCESS {
                return workspace;
            }
            let optimised = optimised_main_job();
            if optimised != ExitCode::SUCCESS {
                return optimised;
            }
            let perftest = optimised_perftest_defaults();
            if perftest != ExitCode::SUCCESS {
                return perftest;
            }
            loom(&[])
        }
        Cmd::Loom { args } => loom(&args),
        Cmd::BenchInsn { workload } => bench_insn::run(workload.as_deref()),
        Cmd::Capture { out, seed } => capture(&out, seed),
        Cmd::InfLint => inf_lint::run(),
        Cmd::VerbsLibs { out, release } => verbs_libs::run(out, release),
        Cmd::WdkCheck { kmdf_headers } => wdk_check::run(kmdf_headers),
        Cmd::Swarm(args) => swarm_run::run(&args),
        Cmd::Fuzz {
            target,
            all,
            seconds,
        } => fuzz::run(target.as_deref(), all, seconds),
        Cmd::Bench { only, quick } => bench::run(&only, quick),
    }
}

/// Builds the main job optimised and runs it (its exit status is the
/// run's): the simulated platform in a debug build is tens of times
/// slower, and building xtask itself in release would slow every CI run.
fn main_job(args: &MainJobArgs) -> ExitCode {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut command = Command::new(cargo);
    command
        .args([
            "run",
            "--quiet",
            "--release",
            "--locked",
            "-p",
            "stack-main-job",
        ])
        .args(["--bin", "main-job", "--"])
        .args(["--hcas", &args.hcas.to_string()])
        .args(["--ports", &args.ports.to_string()])
        .args(["--seed", &args.seed.to_string()]);
    if let Some(capture) = &args.capture {
        command.arg("--capture").arg(capture);
    }
    command.args(&args.extra);
    println!("building the main job (release) and running it...");
    match command.status() {
        Ok(status) if status.success() => ExitCode::SUCCESS,
        Ok(_) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("cannot run cargo: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Writes the scripted mix's capture to `out`.
fn capture(out: &std::path::Path, seed: u64) -> ExitCode {
    let file = match std::fs::File::create(out) {
        Ok(f) => std::io::BufWriter::new(f),
        Err(e) => {
            eprintln!("cannot create {}: {e}", out.display());
            return ExitCode::FAILURE;
        }
    };
    match sim_hca::capture::scripted_mix(file, seed) {
        Ok((report, _)) => {
            println!(
                "wrote {} frames ({} completions checked) to {}",
                report.frames,
                report.completions,
                out.display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("the traffic mix failed: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs the workspace tests, echoing cargo's output, and closes with one
/// summary line over every test binary (`N passed, N failed`), so the last
/// line says what ran rather than the count of some empty doc-test binary.
fn test(extra: &[String]) -> ExitCode {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;

    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let child = Command::new(cargo)
        .args(["test", "--workspace", "--locked"])
        .args(extra)
        .stdout(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(child) => child,
        Err(e) => {
            eprintln!("cannot run cargo: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (mut passed, mut failed) = (0u64, 0u64);
    if let Some(out) = child.stdout.take() {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            println!("{line}");
            if let Some((p, f)) = parse_test_result(&line) {
                passed += p;
                failed += f;
            }
        }
    }
    let status = child.wait();
    println!("\n{passed} passed, {failed} failed");
    match status {
        Ok(status) if status.success() && failed == 0 => ExitCode::SUCCESS,
        _ => ExitCode::FAILURE,
    }
}

/// Runs the main job's tests built optimised, as `cargo xtask run` builds
/// it: the release-only kernel-stack test measures optimised code (a debug
/// build inlines nothing and has its own budget), and the job itself must
/// pass in the build users run.
fn optimised_main_job() -> ExitCode {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    println!("\n== the main job, optimised (cargo test --release -p stack-main-job) ==");
    let status = Command::new(cargo)
        .args(["test", "--locked", "--release", "-p", "stack-main-job"])
        .status();
    match status {
        Ok(s) if s.success() => ExitCode::SUCCESS,
        _ => ExitCode::FAILURE,
    }
}

/// Runs Debian's perftest with its own defaults (iterations and sizes)
/// on our libraries built optimised: the ignored test of
/// `verbs/sim-lib/tests/perftest.rs` (a debug build would take minutes;
/// the default suite runs short ones). Needs Debian's `perftest`.
fn optimised_perftest_defaults() -> ExitCode {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    println!(
        "\n== perftest's defaults on our libraries, optimised (cargo test --release -p sim-libibverbs --test perftest -- --ignored) =="
    );
    let status = Command::new(cargo)
        .args([
            "test",
            "--locked",
            "--release",
            "-p",
            "sim-libibverbs",
            "--test",
            "perftest",
            "--",
            "--ignored",
        ])
        .status();
    match status {
        Ok(s) if s.success() => ExitCode::SUCCESS,
        _ => ExitCode::FAILURE,
    }
}

/// Runs every `loom_` model test of the driver cores, the UVP and our
/// libibverbs' slot table, built with `--cfg loom` in release mode (loom explores thousands of interleavings) into
/// its own target directory, so the normal build stays warm.
fn loom(extra: &[String]) -> ExitCode {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let target = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("target")
        .join("loom");
    let filter: Vec<String> = if extra.is_empty() {
        vec!["loom_".into()]
    } else {
        extra.to_vec()
    };
    println!("\n== loom models (cargo xtask loom) ==");
    let status = Command::new(cargo)
        .args([
            "test",
            "--locked",
            "--release",
            "-p",
            "hca-miniport-core",
            "-p",
            "uvp-plugin",
            "-p",
            "ibverbs-compat",
            "--lib",
            "--",
        ])
        .args(&filter)
        .env("RUSTFLAGS", "--cfg loom")
        .env("CARGO_TARGET_DIR", target)
        .status();
    match status {
        Ok(status) if status.success() => ExitCode::SUCCESS,
        Ok(_) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("cannot run cargo: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The counts of a libtest summary line:
/// `test result: ok. 12 passed; 0 failed; 0 ignored; ...`.
fn parse_test_result(line: &str) -> Option<(u64, u64)> {
    let rest = line.trim().strip_prefix("test result: ")?;
    let mut passed = None;
    let mut failed = None;
    for part in rest.split([';', '.']) {
        let mut words = part.split_whitespace();
        if let (Some(n), Some(what)) = (words.next(), words.next()) {
            match what {
                "passed" => passed = n.parse().ok(),
                "failed" => failed = n.parse().ok(),
                _ => {}
            }
        }
    }
    Some((passed?, failed?))
}

#[cfg(test)]
mod tests {
    use super::parse_test_result;

    #[test]
    fn reads_libtest_summaries() {
        let ok = "test result: ok. 135 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.42s";
        assert_eq!(parse_test_result(ok), Some((135, 0)));
        let bad = "test result: FAILED. 3 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out";
        assert_eq!(parse_test_result(bad), Some((3, 2)));
        assert_eq!(parse_test_result("running 3 tests"), None);
    }
}
