//! `cargo xtask fuzz`: runs the cargo-fuzz targets of `fuzz/` (one parser
//! of untrusted input each; README "Fuzzing").
//!
//! Each run first writes the target's seed corpus (valid inputs from the
//! crates' encoders, by `fuzz/src/bin/seed_corpus.rs`) into
//! `fuzz/corpus/<target>/`, then runs libFuzzer on it for the given time
//! and prints how many inputs it executed. A crash leaves its input in
//! `fuzz/artifacts/<target>/` and fails the command; replay it with
//! `cargo fuzz run <target> <file>`.
//!
//! cargo-fuzz needs a nightly compiler for its sanitizer flags; on the
//! stable toolchain the runs set `RUSTC_BOOTSTRAP=1`. CI does not fuzz
//! (too long): the default test suite runs each target's property as a
//! bounded proptest instead.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

/// The bin of `fuzz/` that writes seed corpora; not a fuzz target.
const SEED_WRITER: &str = "seed_corpus";

/// What one target's run did.
#[derive(Debug)]
struct RunReport {
    target: String,
    seconds: f64,
    executions: Option<u64>,
    passed: bool,
}

/// Runs `target` (or, with `all`, every target in turn) for `seconds`
/// seconds each.
pub(crate) fn run(target: Option<&str>, all: bool, seconds: u64) -> ExitCode {
    let targets = match (target, all) {
        (Some(target), false) => vec![target.to_owned()],
        (None, true) => match list_targets() {
            Ok(targets) => targets,
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::FAILURE;
            }
        },
        _ => {
            eprintln!("name one target, or --all (targets: `cargo fuzz list` in the root)");
            return ExitCode::FAILURE;
        }
    };
    let mut reports = Vec::new();
    for target in &targets {
        match run_one(target, seconds) {
            Ok(report) => reports.push(report),
            Err(e) => {
                eprintln!("{target}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    println!(
        "\n{:<16} {:>8} {:>14}  result",
        "target", "seconds", "executions"
    );
    for r in &reports {
        let executions = r
            .executions
            .map_or_else(|| "?".to_owned(), |n| n.to_string());
        let result = if r.passed { "clean" } else { "FAILED" };
        println!(
            "{:<16} {:>8.0} {:>14}  {result}",
            r.target, r.seconds, executions
        );
    }
    if reports.iter().all(|r| r.passed) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(root()).env("RUSTC_BOOTSTRAP", "1");
    cmd
}

/// The fuzz targets (`cargo fuzz list`, less the seed writer).
fn list_targets() -> Result<Vec<String>, String> {
    let out = cargo()
        .args(["fuzz", "list"])
        .output()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "`cargo fuzz list` failed (is cargo-fuzz installed? `cargo install cargo-fuzz`):\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        .filter(|t| !t.is_empty() && *t != SEED_WRITER)
        .map(str::to_owned)
        .collect())
}

/// Seeds the target's corpus, then fuzzes it for `seconds`.
fn run_one(target: &str, seconds: u64) -> Result<RunReport, String> {
    if target == SEED_WRITER {
        return Err(format!(
            "{SEED_WRITER} writes seeds; it is not a fuzz target"
        ));
    }
    let corpus = root().join("fuzz").join("corpus");
    let status = cargo()
        .args([
            "run",
            "--quiet",
            "--release",
            "--manifest-path",
            "fuzz/Cargo.toml",
            "--bin",
            SEED_WRITER,
            "--",
        ])
        .arg(&corpus)
        .arg(target)
        .status()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !status.success() {
        return Err("writing the seed corpus failed (unknown target?)".into());
    }

    println!("\n== cargo fuzz run {target} ({seconds} s) ==");
    let started = Instant::now();
    let mut fuzzed_seconds = None;
    let mut child = cargo()
        .args(["fuzz", "run", target, "--"])
        .arg(format!("-max_total_time={seconds}"))
        .arg("-print_final_stats=1")
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run cargo fuzz (`cargo install cargo-fuzz`): {e}"))?;
    let mut executions = None;
    if let Some(err) = child.stderr.take() {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            eprintln!("{line}");
            if let Some(n) = line.strip_prefix("stat::number_of_executed_units:") {
                executions = n.trim().parse().ok();
            }
            // libFuzzer's closing line: `Done 71861 runs in 11 second(s)`.
            if let Some(rest) = line.strip_prefix("Done ")
                && let Some((_, after)) = rest.split_once(" runs in ")
            {
                fuzzed_seconds = after.split_whitespace().next().and_then(|s| s.parse().ok());
            }
        }
    }
    let status = child
        .wait()
        .map_err(|e| format!("cargo fuzz did not finish: {e}"))?;
    Ok(RunReport {
        target: target.to_owned(),
        // The fuzzing time, without building; the wall time if libFuzzer
        // stopped early (a crash).
        seconds: fuzzed_seconds.unwrap_or_else(|| started.elapsed().as_secs_f64()),
        executions,
        passed: status.success(),
    })
}
