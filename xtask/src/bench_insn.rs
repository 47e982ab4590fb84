//! `cargo xtask bench-insn`: issue 13's measurement 4, instructions per
//! operation counted by callgrind (docs/performance.md "Instructions per
//! operation").
//!
//! Builds `stack-bench`'s `insn_count` optimised, then runs each of its
//! workloads under `valgrind --tool=callgrind` collecting only inside the
//! workload's `#[inline(never)]` measured function (`--toggle-collect`),
//! so the simulated host's set-up, device and fabric between rounds are
//! never counted. What runs inside the measured function is then taken
//! apart by the inclusive costs of the calls in the profile (the
//! `calls=` lines of the callgrind file, what `callgrind_annotate
//! --inclusive=yes` sums):
//! - the simulated HCA's MMIO handler, which a doorbell store runs in the
//!   storing thread, is taken off (a real device's work is no CPU
//!   instruction);
//! - **platform emulation**: every call from the measured code into the
//!   simulated platform's implementation of a platform trait (a sim-host
//!   type `as driver_platform::…` or `as lock_api::…`: the MMIO store,
//!   kernel memory reads, common-buffer access, spin locks, reader-writer
//!   spin locks, IRQL queries) and the plugin's doorbell hook, by kind.
//!   On Windows each is a few instructions to a few dozen
//!   (docs/performance.md says what runs there instead);
//! - **driver's own**: the rest, on which the goal (150 per post_send, 100
//!   per polled CQE) is judged. The `compat-*` workloads (our
//!   `libibverbs.so.1`'s post, receive and poll over the plugin) have no
//!   goal: their own part is the plugin's and the library's.
//!
//! The callgrind files stay in `target/insn/` for `callgrind_annotate
//! --inclusive=yes` (the breakdowns docs/performance.md quotes).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

/// One workload: its `insn_count` argument, its measured function, and
/// the goal in instructions per operation (none for our libibverbs'
/// entry points, which are the plugin's work plus the library's).
struct Workload {
    name: &'static str,
    function: &'static str,
    goal: Option<u64>,
}

/// The plugin's doorbell store on the simulated host (its MMIO hook, the
/// access library's OS seam rather than a platform trait).
const USER_MMIO_STORE: &str =
    "<sim_shells::user_io::SimIo as ibal_user::device::DeviceIo>::doorbell_hook::{{closure}}";

const WORKLOADS: [Workload; 7] = [
    Workload {
        name: "driver-post",
        function: "measured_driver_post",
        goal: Some(150),
    },
    Workload {
        name: "driver-poll",
        function: "measured_driver_poll",
        goal: Some(100),
    },
    Workload {
        name: "plugin-post",
        function: "measured_plugin_post",
        goal: Some(150),
    },
    Workload {
        name: "plugin-poll",
        function: "measured_plugin_poll",
        goal: Some(100),
    },
    Workload {
        name: "compat-post",
        function: "measured_compat_post",
        goal: None,
    },
    Workload {
        name: "compat-recv",
        function: "measured_compat_recv",
        goal: None,
    },
    Workload {
        name: "compat-poll",
        function: "measured_compat_poll",
        goal: None,
    },
];

/// The simulated HCA's MMIO handler: a doorbell store runs the device's
/// send engine in the storing thread; what it costs inside the measured
/// function is taken off the count.
const SIMULATED_DEVICE: &str = "sim_hca::device::Device::mmio_write64";

/// The kinds of simulated-platform primitive the count takes apart, in
/// the order they are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Primitive {
    /// A store to device memory (`Mmio`, the plugin's doorbell hook).
    Mmio,
    /// Reading kernel virtual memory (`MemoryLocker::read_kernel`).
    KernelMemory,
    /// Reading or writing a DMA common buffer (`CommonBuffer`).
    CommonBuffer,
    /// A spin lock's acquire or release (`KSPIN_LOCK`, `lock_api::RawMutex`).
    SpinLock,
    /// A reader-writer spin lock's (`EX_SPIN_LOCK`, `lock_api::RawRwLock`).
    RwSpinLock,
    /// The IRQL query (`IrqlQuery`).
    Irql,
    /// Any other platform trait.
    Other,
}

impl Primitive {
    const ALL: [Self; 7] = [
        Self::Mmio,
        Self::KernelMemory,
        Self::CommonBuffer,
        Self::SpinLock,
        Self::RwSpinLock,
        Self::Irql,
        Self::Other,
    ];

    fn label(self) -> &'static str {
        match self {
            Self::Mmio => "mmio",
            Self::KernelMemory => "kmem",
            Self::CommonBuffer => "cbuf",
            Self::SpinLock => "spin",
            Self::RwSpinLock => "rwspin",
            Self::Irql => "irql",
            Self::Other => "other",
        }
    }

    /// The primitive `function` (a callgrind function name) implements, if
    /// it is a simulated-platform entry point: a sim-host type's method of
    /// a `driver_platform` or `lock_api` trait (not a closure or helper
    /// inside one: those are counted through their entry point), or the
    /// plugin's doorbell hook.
    pub(crate) fn of(function: &str) -> Option<Self> {
        if function == USER_MMIO_STORE {
            return Some(Self::Mmio);
        }
        let rest = function.strip_prefix("<sim_host::")?;
        let (_, rest) = rest.split_once(" as ")?;
        let (trait_path, method) = rest.split_once(">::")?;
        if method.contains("::") {
            return None;
        }
        let kind = match trait_path {
            t if t.starts_with("driver_platform::mmio::") => Self::Mmio,
            "driver_platform::dma::MemoryLocker" => Self::KernelMemory,
            "driver_platform::dma::CommonBuffer" => Self::CommonBuffer,
            t if t.starts_with("lock_api::mutex::") => Self::SpinLock,
            t if t.starts_with("lock_api::rwlock::") => Self::RwSpinLock,
            t if t.starts_with("driver_platform::irql::") => Self::Irql,
            t if t.starts_with("driver_platform::") || t.starts_with("lock_api::") => Self::Other,
            _ => return None,
        };
        Some(kind)
    }
}

/// Whether `function` is the simulators' (sim-host, its shells, the
/// simulated HCA): a platform entry point it calls is part of the work of
/// the entry point that called it, not a call of the measured code.
fn is_simulator(function: &str) -> bool {
    let path = function.strip_prefix('<').unwrap_or(function);
    ["sim_host::", "sim_shells::", "sim_hca::"]
        .iter()
        .any(|crate_path| path.starts_with(crate_path))
}

/// One workload's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Count {
    /// Instructions collected inside the measured function, the simulated
    /// device's taken off.
    pub(crate) instructions: u64,
    /// Of them, the simulated platform's, by primitive (the device's work
    /// inside a doorbell store taken off).
    pub(crate) emulation: Vec<(Primitive, u64)>,
    /// Calls of the measured function.
    pub(crate) ops: u64,
}

impl Count {
    /// Instructions per operation, rounded to the nearest.
    pub(crate) fn per_op(&self) -> u64 {
        self.spread(self.instructions)
    }

    /// The simulated platform's instructions in all.
    fn emulation_total(&self) -> u64 {
        self.emulation.iter().map(|(_, n)| n).sum()
    }

    /// The simulated platform's instructions per operation.
    pub(crate) fn emulation_per_op(&self) -> u64 {
        self.spread(self.emulation_total())
    }

    /// `primitive`'s instructions per operation.
    pub(crate) fn primitive_per_op(&self, primitive: Primitive) -> u64 {
        self.spread(
            self.emulation
                .iter()
                .filter(|(p, _)| *p == primitive)
                .map(|(_, n)| n)
                .sum(),
        )
    }

    /// The driver's (or plugin's) own instructions per operation, outside
    /// every simulated-platform primitive: what the goal is judged on.
    pub(crate) fn judged_per_op(&self) -> u64 {
        self.spread(self.instructions.saturating_sub(self.emulation_total()))
    }

    fn spread(&self, instructions: u64) -> u64 {
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
    println!(
        "total = platform emulation (simulated; by primitive) + own code, which the goal is \
         judged on"
    );
    let mut failed = false;
    for w in WORKLOADS
        .iter()
        .filter(|w| filter.is_none_or(|f| w.name.contains(f)))
    {
        let out_file = out_dir.join(format!("{}.callgrind", w.name));
        match count(&binary, w, &out_file) {
            Ok(c) => println!("{}   ({} ops, {})", line(w, &c), c.ops, out_file.display()),
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

/// The printed line of one workload's count.
fn line(w: &Workload, c: &Count) -> String {
    let parts: Vec<String> = Primitive::ALL
        .iter()
        .map(|&p| (p, c.primitive_per_op(p)))
        .filter(|&(_, n)| n > 0)
        .map(|(p, n)| format!("{} {n}", p.label()))
        .collect();
    let judged = c.judged_per_op();
    let goal = match w.goal {
        Some(goal) => format!(
            "goal <= {goal:>3}   {}",
            if judged <= goal { "met" } else { "MISSED" }
        ),
        None => "(no goal)".to_owned(),
    };
    format!(
        "{:<12} {:>6} instructions/op = platform emulation {:>5} ({}) + own {:>5}   {goal}",
        w.name,
        c.per_op(),
        c.emulation_per_op(),
        if parts.is_empty() {
            "none".to_owned()
        } else {
            parts.join(", ")
        },
        judged,
    )
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
    let profile = Profile::parse(&profile).ok_or("no totals in the callgrind output")?;
    Ok(profile.count(ops))
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

/// What the count needs of a callgrind profile: its instruction total and
/// the inclusive cost of every call, by caller and callee.
#[derive(Debug, Default)]
struct Profile {
    total: u64,
    /// Inclusive cost by (caller, callee) name.
    calls: HashMap<(String, String), u64>,
}

impl Profile {
    /// Parses a callgrind output file (its first event being `Ir`): the
    /// `totals:` (or `summary:`) line, the `fn=`/`cfn=` names (compressed
    /// as `(id) name`, then `(id)`), and each `calls=` line's following
    /// cost line, which is the call's inclusive cost. `None` without a
    /// total.
    fn parse(text: &str) -> Option<Self> {
        let mut names: HashMap<String, String> = HashMap::new();
        let mut name = |spec: &str| -> String {
            let spec = spec.trim();
            match spec.strip_prefix('(').and_then(|s| s.split_once(')')) {
                Some((id, rest)) if rest.trim().is_empty() => {
                    names.get(id).cloned().unwrap_or_default()
                }
                Some((id, rest)) => {
                    names.insert(id.to_owned(), rest.trim().to_owned());
                    rest.trim().to_owned()
                }
                None => spec.to_owned(),
            }
        };
        let mut profile = Self::default();
        let (mut summary, mut totals) = (None, None);
        let mut caller = String::new();
        let mut callee = String::new();
        let mut call_follows = false;
        for line in text.lines() {
            if let Some(spec) = line.strip_prefix("fn=") {
                caller = name(spec);
            } else if let Some(spec) = line.strip_prefix("cfn=") {
                callee = name(spec);
            } else if line.starts_with("calls=") {
                call_follows = true;
            } else if let Some(n) = line.strip_prefix("totals:") {
                totals = n.split_whitespace().next().and_then(|n| n.parse().ok());
            } else if let Some(n) = line.strip_prefix("summary:") {
                summary = n.split_whitespace().next().and_then(|n| n.parse().ok());
            } else if call_follows {
                call_follows = false;
                let cost: u64 = line
                    .split_whitespace()
                    .nth(1)
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0);
                *profile
                    .calls
                    .entry((caller.clone(), callee.clone()))
                    .or_default() += cost;
            }
        }
        profile.total = totals.or(summary)?;
        Some(profile)
    }

    /// The inclusive cost of the calls into `callee` from functions that
    /// `outside` accepts.
    fn calls_into(&self, callee: &str, outside: impl Fn(&str) -> bool) -> u64 {
        self.calls
            .iter()
            .filter(|((from, to), _)| to == callee && outside(from))
            .map(|(_, cost)| cost)
            .sum()
    }

    /// The count of a workload of `ops` calls: the simulated device's work
    /// taken off, the platform's calls by primitive (each entry point's
    /// calls from the measured code, never from inside the simulators,
    /// where one entry point's work may run another's; the device's work
    /// inside a doorbell store taken off the MMIO part).
    fn count(&self, ops: u64) -> Count {
        let device = self.calls_into(SIMULATED_DEVICE, |from| from != SIMULATED_DEVICE);
        let mut by_primitive: HashMap<Primitive, u64> = HashMap::new();
        let mut entries: Vec<&String> = self.calls.keys().map(|(_, to)| to).collect();
        entries.sort();
        entries.dedup();
        for callee in entries {
            if let Some(primitive) = Primitive::of(callee) {
                *by_primitive.entry(primitive).or_default() +=
                    self.calls_into(callee, |from| !is_simulator(from));
            }
        }
        if let Some(mmio) = by_primitive.get_mut(&Primitive::Mmio) {
            *mmio = mmio.saturating_sub(device);
        }
        let mut emulation: Vec<(Primitive, u64)> = by_primitive.into_iter().collect();
        emulation.sort();
        Count {
            instructions: self.total.saturating_sub(device),
            emulation,
            ops,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ops_line_is_read() {
        let stdout = "noise\nops driver-post 512\n";
        assert_eq!(parse_ops(stdout, "driver-post"), Some(512));
        assert_eq!(parse_ops(stdout, "driver-poll"), None);
    }

    #[test]
    fn platform_entry_points_are_told_by_their_trait() {
        let of = Primitive::of;
        assert_eq!(
            of("<sim_host::pci::Bar0 as driver_platform::mmio::Mmio>::write64"),
            Some(Primitive::Mmio)
        );
        assert_eq!(of(USER_MMIO_STORE), Some(Primitive::Mmio));
        assert_eq!(
            of("<sim_host::dma::HostLocker as driver_platform::dma::MemoryLocker>::read_kernel"),
            Some(Primitive::KernelMemory)
        );
        assert_eq!(
            of("<sim_host::dma::HostCommonBuffer as driver_platform::dma::CommonBuffer>::read"),
            Some(Primitive::CommonBuffer)
        );
        assert_eq!(
            of("<sim_host::irql::HostSpinLock as lock_api::mutex::RawMutex>::unlock"),
            Some(Primitive::SpinLock)
        );
        assert_eq!(
            of(
                "<sim_host::rw_spin_lock::HostRwSpinLock as lock_api::rwlock::RawRwLock>::lock_shared"
            ),
            Some(Primitive::RwSpinLock)
        );
        assert_eq!(
            of("<sim_host::irql::IrqlTracker as driver_platform::irql::IrqlQuery>::current_irql"),
            Some(Primitive::Irql)
        );
        // Not entry points: a closure inside one, a helper, the device's
        // own access to host memory, the driver.
        assert_eq!(
            of(
                "<sim_host::rw_spin_lock::HostRwSpinLock as lock_api::rwlock::RawRwLock>::lock_shared::{{closure}}"
            ),
            None
        );
        assert_eq!(of("sim_host::memory::read_pages"), None);
        assert_eq!(
            of("<sim_host::pci::DmaPort as sim_hca::host::HostMemory>::read"),
            None
        );
        assert_eq!(
            of("hca_miniport_core::ci::CiProvider<P,R>::post_send"),
            None
        );
    }

    /// A profile shaped as callgrind writes one (compressed names, a call's
    /// inclusive cost on the line after `calls=`): the measured function
    /// calls the driver, which takes a spin lock and stores a doorbell; the
    /// store runs the simulated device and, through a helper, takes a lock
    /// of its own (inside the entry point, so not counted twice).
    const PROFILE: &str = "# callgrind format
version: 1
positions: line
events: Ir
summary: 10000

ob=(1) /t/insn_count
fl=(1) bench/src/bin/insn_count.rs
fn=(1) insn_count::measured_driver_post
5 10
cfl=(2) hca-miniport/core/src/ci.rs
cfn=(2) hca_miniport_core::ci::CiProvider<P,R>::post_send
calls=2 10
* 9990

fl=(2)
fn=(2)
20 1000
cfl=(3) sim-host/src/irql.rs
cfn=(3) <sim_host::irql::HostSpinLock as lock_api::mutex::RawMutex>::lock
calls=2 300
+1 200
cfn=(4) <sim_host::pci::Bar0 as driver_platform::mmio::Mmio>::write64
calls=2 40
* 8790

fl=(3)
fn=(4)
41 90
cfn=(5) sim_hca::device::Device::mmio_write64
calls=2 7
* 8000
cfn=(6) sim_host::pci::Backplane::collect_interrupts
calls=2 300
* 700

fn=(6)
300 200
cfn=(3)
calls=2 300
* 500

totals: 10000
";

    #[test]
    fn a_profile_is_taken_apart_by_its_calls() {
        let profile = Profile::parse(PROFILE).expect("a profile");
        assert_eq!(profile.total, 10_000);
        let count = profile.count(2);
        assert_eq!(count.instructions, 2_000, "the device's 8,000 taken off");
        assert_eq!(
            count.emulation,
            [(Primitive::Mmio, 790), (Primitive::SpinLock, 200)],
            "the lock inside the store is the store's"
        );
        assert_eq!(count.per_op(), 1_000);
        assert_eq!(count.primitive_per_op(Primitive::Mmio), 395);
        assert_eq!(count.emulation_per_op(), 495);
        assert_eq!(count.judged_per_op(), 505);
        let w = &WORKLOADS[0];
        assert_eq!(
            line(w, &count),
            "driver-post    1000 instructions/op = platform emulation   495 (mmio 395, spin 100) \
             + own   505   goal <= 150   MISSED"
        );
        // The older files' `summary:` stands in for `totals:`.
        let old = PROFILE.replace("totals: 10000\n", "");
        assert_eq!(Profile::parse(&old).map(|p| p.total), Some(10_000));
        assert!(Profile::parse("events: Ir\n").is_none());
    }
}
