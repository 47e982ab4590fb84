//! `cargo xtask bench [--only 1,2,...] [--quick]`: builds the benchmark
//! suite (`stack-bench`, `bench/`) optimised and runs it. Each line it
//! prints is a measurement, its baseline measured in the same run, the
//! ratio and the goal (issue 13; results in docs/performance.md).
//! Measurement 4 (instructions per operation) is `insn_count` under
//! callgrind, not part of this command.

use std::process::{Command, ExitCode};

/// Builds and runs `stack-bench --release` with `only` (measurement
/// numbers, all when empty) and `quick`.
pub(crate) fn run(only: &[u8], quick: bool) -> ExitCode {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut command = Command::new(cargo);
    command.args([
        "run",
        "--locked",
        "--release",
        "-p",
        "stack-bench",
        "--bin",
        "stack-bench",
        "--",
    ]);
    if !only.is_empty() {
        let list: Vec<String> = only.iter().map(u8::to_string).collect();
        command.arg(format!("--only={}", list.join(",")));
    }
    if quick {
        command.arg("--quick");
    }
    match command.status() {
        Ok(status) if status.success() => ExitCode::SUCCESS,
        Ok(_) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("cannot run cargo: {e}");
            ExitCode::FAILURE
        }
    }
}
