//! `main-job`: the main job's command line (`cargo xtask run` builds and
//! runs it optimised; README "Quick start"). Exits non-zero if any step
//! failed or the verifier reported anything.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use stack_main_job::{Options, Sabotage};

// The drivers' heap calls above DISPATCH_LEVEL are violations
// (docs/host-model.md, "Heap above DISPATCH_LEVEL").
sim_host::install_driver_heap_check!();

/// The whole stack on the simulated Windows host, watched and checked.
#[derive(Debug, Parser)]
#[command(name = "main-job")]
struct Args {
    /// HCAs on the PCI bus, 2 to 8 (HCA 2k pairs with HCA 2k + 1 port by
    /// port; an odd last HCA's ports pair with each other).
    #[arg(long, default_value_t = 2)]
    hcas: usize,
    /// Ports per HCA (2 to 4).
    #[arg(long, default_value_t = 2)]
    ports: u8,
    /// Seed of the simulation: the run is reproducible from it.
    #[arg(long, default_value_t = 2026)]
    seed: u64,
    /// Write a pcap capture of the fabric's frames (open it in Wireshark).
    #[arg(long)]
    capture: Option<PathBuf>,
    /// Ping-pong rounds per kernel-client connection.
    #[arg(long, default_value_t = 64)]
    rounds: u32,
    /// Rounds of the user application.
    #[arg(long, default_value_t = 256)]
    user_rounds: u32,
    /// Payload bytes of the user application's send, write and read.
    #[arg(long, default_value_t = 4096)]
    user_bytes: usize,
    /// Print the ABI contract's full tables.
    #[arg(long)]
    abi: bool,
    /// Break a step on purpose (the run must fail, naming it).
    #[arg(long, value_parser = ["corrupt-read", "drop-frames"])]
    sabotage: Option<String>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let options = Options {
        hcas: args.hcas,
        ports: args.ports,
        seed: args.seed,
        capture: args.capture,
        rounds: args.rounds,
        user_rounds: args.user_rounds,
        user_bytes: args.user_bytes,
        // indicatif draws only on a terminal; the lines print either way.
        interactive: true,
        sabotage: match args.sabotage.as_deref() {
            Some("corrupt-read") => Some(Sabotage::CorruptRead),
            Some("drop-frames") => Some(Sabotage::DropFrames),
            _ => None,
        },
        abi_tables: args.abi,
    };
    let report = stack_main_job::run(&options);
    print!("{}", report.summary);
    if report.success() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
