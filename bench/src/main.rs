//! `stack-bench`: the benchmark suite of issue 13 (`cargo xtask bench`).
//! Each measurement runs beside a baseline measured in the same process
//! and prints the measurement, its baseline, the ratio and the goal
//! (docs/performance.md).

use clap::Parser;
use stack_bench::alloc_count::CountingAlloc;
use stack_bench::suite::{ALL, Effort, run};

/// Live heap bytes, for the memory-per-QP measurement.
#[global_allocator]
static HEAP: CountingAlloc = CountingAlloc;

#[derive(Debug, Parser)]
#[command(about = "Benchmarks of the stack against same-run baselines")]
struct Args {
    /// Measurements to run, comma-separated (1 latency, 2 message rate,
    /// 3 bandwidth, 5 control path, 6 scale); all when none is given.
    #[arg(long = "only", value_delimiter = ',')]
    only: Vec<u8>,
    /// Few repetitions and small counts: checks the harness, not the
    /// numbers.
    #[arg(long)]
    quick: bool,
}

fn main() {
    let args = Args::parse();
    let which: Vec<u8> = if args.only.is_empty() {
        ALL.to_vec()
    } else {
        args.only.clone()
    };
    if let Some(bad) = which.iter().find(|m| !ALL.contains(m)) {
        eprintln!("stack-bench: no measurement {bad} (there are {ALL:?}; 4 is insn_count)");
        std::process::exit(2);
    }
    let effort = Effort::new(args.quick);
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "stack-bench: {} run, {cpus} CPUs, medians of {} interleaved repetitions",
        if args.quick { "quick" } else { "full" },
        effort.reps
    );
    let (_lines, findings) = run(&which, effort);
    if !findings.is_empty() {
        eprintln!("stack-bench: the verifier found:");
        for finding in &findings {
            eprintln!("  {finding}");
        }
        std::process::exit(1);
    }
}
