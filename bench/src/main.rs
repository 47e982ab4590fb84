//! `stack-bench`: the benchmark suite of issue 13 (`cargo xtask bench`).
//! Each measurement runs beside a baseline measured in the same process
//! and prints the measurement, its baseline, the ratio and the goal
//! (docs/performance.md).

fn main() {
    println!("stack-bench: no measurements yet");
}
