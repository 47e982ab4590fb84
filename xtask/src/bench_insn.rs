//! `cargo xtask bench-insn`: issue 13's measurement 4, instructions per
//! operation counted by callgrind (docs/performance.md "Instructions per
//! operation").
//!
//! Builds `stack-bench`'s `insn_count` optimised, then runs each of its
//! workloads under `valgrind --tool=callgrind` collecting only inside the
//! workload's `#[inline(never)]` measured function
//! (`--toggle-collect`), so the simulated host's set-up, device and fabric
//! are never counted; and the inclusive cost of the simulated HCA's MMIO
//! handler, which a doorbell store runs in the storing thread, is taken
//! off (a real device's work is no CPU instruction; `callgrind_annotate
//! --inclusive=yes` tells it). The platform's side of the store
//! (`sim_host::pci::Bar0`, the plugin's MMIO hook) is counted. Prints instructions per operation against the goal
//! (150 per post_send, 100 per polled CQE). The callgrind files stay in
//! `target/insn/` for `callgrind_annotate --inclusive=yes` (the breakdown
//! docs/performance.md quotes).

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

/// One workload: its `insn_count` argument, its measured function, the
/// function through which its doorbell store enters the simulator (if it
/// rings one), and the goal in instructions per operation.
struct Workload {
    name: &'static str,
    function: &'static str,
    mmio_store: Option<&'static str>,
    goal: u64,
}

/// The miniport's doorbell store on the simulated host.
const KERNEL_MMIO_STORE: &str = "<sim_host::pci::Bar0 as driver_platform::mmio::Mmio>::write64";
/// The plugin's doorbell store on the simulated host (its MMIO hook).
const USER_MMIO_STORE: &str =
    "<sim_shells::user_io::SimIo as ibal_user::device::DeviceIo>::doorbell_hook::{{closure}}";

const WORKLOADS: [Workload; 4] = [
    Workload {
        name: "driver-post",
        function: "measured_driver_post",
        mmio_store: Some(KERNEL_MMIO_STORE),
        goal: 150,
    },
    Workload {
        name: "driver-poll",
        function: "measured_driver_poll",
        mmio_store: None,
        goal: 100,
    },
    Workload {
        name: "plugin-post",
        function: "measured_plugin_post",
        mmio_store: Some(USER_MMIO_STORE),
        goal: 150,
    },
    Workload {
        name: "plugin-poll",
        function: "measured_plugin_poll",
        mmio_store: None,
        goal: 100,
    },
];

/// The simulated HCA's MMIO handler: a doorbell store runs the device's
/// send engine in the storing thread; what it costs inside the measured
/// function is taken off the count.
const SIMULATED_DEVICE: &str = "sim_hca::device::Device::mmio_write64";

/// One workload's result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Count {
    /// Instructions collected inside the measured function, the simulated
    /// device's taken off.
    pub(crate) instructions: u64,
    /// Of them, the simulated platform's side of the doorbell stores
    /// (a real CPU's is one store instruction).
    pub(crate) mmio_emulation: u64,
    /// Calls of the measured function.
    pub(crate) ops: u64,
}

impl Count {
    /// Instructions per operation, rounded to the nearest.
    pub(crate) fn per_op(self) -> u64 {
        self.spread(self.instructions)
    }

    /// The simulated MMIO store's instructions per operation.
    pub(crate) fn mmio_per_op(self) -> u64 {
        self.spread(self.mmio_emulation)
    }

    /// Instructions per operation outside the simulated MMIO store: what
    /// the goal is judged on.
    pub(crate) fn judged_per_op(self) -> u64 {
        self.spread(self.instructions - self.mmio_emulation)
    }

    fn spread(self, instructions: u64) -> u64 {
        (instructions + self.ops / 2) / self.ops.max(1)
    }
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs every workload (or those whose name contains `filter`) and prints
/// its line; fails if a workload or the tools fail, not if a goal is
/// missed (docs/performance.md explains each gap).
pub(crate) fn run(filter: Option<&str>) -> ExitCode {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let built = Command::new(cargo)
        .args([
            "build",
            "--locked",
            "--release",
            "-p",
            "stack-bench",
            "--bin",
            "insn_count",
        ])
        .current_dir(workspace())
        .status();
    if !matches!(built, Ok(s) if s.success()) {
        eprintln!("building insn_count failed");
        return ExitCode::FAILURE;
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target"));
    let binary = target.join("release").join("insn_count");
    let out_dir = target.join("insn");
    if let Err(e) = std::fs::create_dir_all(&out_dir) {
        eprintln!("cannot create {}: {e}", out_dir.display());
        return ExitCode::FAILURE;
    }
    println!("\n== instructions per operation (callgrind; issue 13, measurement 4) ==");
    let mut failed = false;
    for w in WORKLOADS
        .iter()
        .filter(|w| filter.is_none_or(|f| w.name.contains(f)))
    {
        let out_file = out_dir.join(format!("{}.callgrind", w.name));
        match count(&binary, w, &out_file) {
            Ok(c) => println!(
                "{:<12} {:>6} instructions/op ({:>4} in the simulated MMIO store) -> {:>5}   \
                 goal <= {:>3}   {}   ({} ops, {})",
                w.name,
                c.per_op(),
                c.mmio_per_op(),
                c.judged_per_op(),
                w.goal,
                if c.judged_per_op() <= w.goal {
                    "met"
                } else {
                    "MISSED"
                },
                c.ops,
                out_file.display()
            ),
            Err(e) => {
                eprintln!("{}: {e}", w.name);
                failed = true;
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// Runs `w` under callgrind into `out_file`.
fn count(binary: &Path, w: &Workload, out_file: &Path) -> Result<Count, String> {
    let output = Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}", out_file.display()))
        .arg(format!("--toggle-collect=*{}*", w.function))
        .arg(binary)
        .arg(w.name)
        .output()
        .map_err(|e| format!("cannot run valgrind (is it installed?): {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "the workload failed: {}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let ops = parse_ops(&stdout, w.name).ok_or("no `ops` line in the workload's output")?;
    let profile = std::fs::read_to_string(out_file)
        .map_err(|e| format!("cannot read {}: {e}", out_file.display()))?;
    let total = parse_total(&profile).ok_or("no totals in the callgrind output")?;
    let annotated = Command::new("callgrind_annotate")
        .args(["--inclusive=yes", "--threshold=100"])
        .arg(out_file)
        .output()
        .map_err(|e| format!("cannot run callgrind_annotate: {e}"))?;
    let annotated = String::from_utf8_lossy(&annotated.stdout);
    let device = inclusive_cost(&annotated, SIMULATED_DEVICE);
    let store = w.mmio_store.map_or(0, |f| inclusive_cost(&annotated, f));
    Ok(Count {
        instructions: total.saturating_sub(device),
        mmio_emulation: store.saturating_sub(device),
        ops,
    })
}

/// The `ops <workload> <n>` line `insn_count` prints.
fn parse_ops(stdout: &str, workload: &str) -> Option<u64> {
    stdout.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        (words.next() == Some("ops") && words.next() == Some(workload))
            .then(|| words.next()?.parse().ok())
            .flatten()
    })
}

/// The instruction total of a callgrind profile (`totals:`, or the
/// `summary:` line older versions write), its first event being `Ir`.
fn parse_total(profile: &str) -> Option<u64> {
    let line = profile
        .lines()
        .find(|l| l.starts_with("totals:"))
        .or_else(|| profile.lines().find(|l| l.starts_with("summary:")))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// The inclusive cost of `function` in `callgrind_annotate --inclusive=yes`
/// output: the largest of its lines (it has one per source file its
/// inlined code came from, the whole function's being the largest); 0 if
/// it never ran.
fn inclusive_cost(annotated: &str, function: &str) -> u64 {
    annotated
        .lines()
        .filter(|line| {
            // `<Ir> (<%>)  <file>:<function> [<object>]`; the function
            // may hold spaces (`<A as B>::f`).
            let line = line.trim_end();
            let line = line
                .strip_suffix(']')
                .and_then(|l| l.rfind(" [").map(|at| &l[..at]))
                .unwrap_or(line);
            line.ends_with(function) && line[..line.len() - function.len()].ends_with(':')
        })
        .filter_map(|line| {
            line.split_whitespace()
                .next()?
                .replace(',', "")
                .parse()
                .ok()
        })
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ops_line_and_the_totals_are_read() {
        let stdout = "noise\nops driver-post 512\n";
        assert_eq!(parse_ops(stdout, "driver-post"), Some(512));
        assert_eq!(parse_ops(stdout, "driver-poll"), None);
        let profile = "events: Ir\nfn=(1) x\n3 4\nsummary: 81920\ntotals: 81920\n";
        assert_eq!(parse_total(profile), Some(81920));
        let count = Count {
            instructions: 81920,
            mmio_emulation: 30720,
            ops: 512,
        };
        assert_eq!(
            (count.per_op(), count.mmio_per_op(), count.judged_per_op()),
            (160, 60, 100)
        );
        let annotated = "1,461,828 (21.06%)  /w/sim-hca/src/device/mod.rs:sim_hca::device::Device::mmio_write64\n\
             1,425,988 (20.54%)  sim-hca/src/transport/send.rs:sim_hca::device::Device::mmio_write64\n\
             9,999,999 (99.00%)  x.rs:sim_hca::device::Device::mmio_write64_other\n";
        assert_eq!(inclusive_cost(annotated, SIMULATED_DEVICE), 1_461_828);
        assert_eq!(inclusive_cost("", SIMULATED_DEVICE), 0);
        let annotated = "1,613,425 (60.53%)  /w/sim-host/src/pci.rs:<sim_host::pci::Bar0 as driver_platform::mmio::Mmio>::write64\n\
             1,591,281 (59.70%)  sim-host/src/pci.rs:<sim_host::pci::Bar0 as driver_platform::mmio::Mmio>::write64 [/t/insn_count]\n";
        assert_eq!(inclusive_cost(annotated, KERNEL_MMIO_STORE), 1_613_425);
    }
}
