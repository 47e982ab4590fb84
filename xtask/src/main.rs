//! Project automation, run as `cargo xtask <command>` (a cargo alias).
//!
//! - `run`: the main job. Until the simulated platform exists it reports and
//!   checks the stack's ABI contract (see `abi_report`); it will boot the
//!   simulated host and run RDMA traffic once issues 3-5 land.
//! - `test`: the test suite, exactly what CI runs after its lint gates.

mod abi_report;

use std::process::{Command, ExitCode};

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(about = "Project automation for the InfiniBand stack")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// The main job: today, report and check the ABI contract.
    Run,
    /// Run the workspace tests (extra arguments go to `cargo test`).
    Test {
        /// Passed through to `cargo test`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Cmd::Run => match abi_report::run() {
            Ok(()) => ExitCode::SUCCESS,
            Err(problems) => {
                for p in &problems {
                    eprintln!("ABI contract problem: {p}");
                }
                ExitCode::FAILURE
            }
        },
        Cmd::Test { args } => cargo(&["test", "--workspace", "--locked"], &args),
    }
}

/// Runs cargo with `base` then `extra` arguments, forwarding its exit code.
fn cargo(base: &[&str], extra: &[String]) -> ExitCode {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    match Command::new(cargo).args(base).args(extra).status() {
        Ok(status) if status.success() => ExitCode::SUCCESS,
        Ok(status) => ExitCode::from(u8::try_from(status.code().unwrap_or(1)).unwrap_or(1)),
        Err(e) => {
            eprintln!("cannot run cargo: {e}");
            ExitCode::FAILURE
        }
    }
}
