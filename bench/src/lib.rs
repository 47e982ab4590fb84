//! `stack-bench`: the benchmark suite of issue 13 (`cargo xtask bench`,
//! docs/performance.md). Each measurement runs the real miniport, bus
//! filter, access library and plugin on the simulated host, beside a
//! baseline measured in the same process, interleaved with it, with the
//! same number of threads (never more spinning threads than two), and
//! [`report::Line`] prints the measurement, its baseline, the ratio and
//! the goal.

pub mod alloc_count;
pub mod baseline;
pub mod control;
pub mod kernel;
pub mod report;
pub mod scale;
pub mod spin;
pub mod suite;
pub mod user_path;
pub mod world;
