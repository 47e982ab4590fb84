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
    // On a thread of its own: the host measures driver routines' stack use
    // from the thread's bounds (`pthread_getattr_np`), which under valgrind
    // (callgrind, docs/performance.md) are exact for a spawned thread only.
    let (_lines, findings) = std::thread::Builder::new()
        .name("stack-bench".into())
        .stack_size(16 << 20)
        .spawn(move || run(&which, effort))
        .expect("the suite's thread")
        .join()
        .expect("the suite panicked");
    if !findings.is_empty() {
        eprintln!("stack-bench: the verifier found:");
        for finding in &findings {
            eprintln!("  {finding}");
        }
        std::process::exit(1);
    }
}
