//! The measurements as report lines, and how much work each does.

use crate::baseline;
use crate::control::{self, Al, Direct};
use crate::report::{Goal, Line, interleaved};
use crate::scale;
use crate::user_path::{self, Shape, with_connection};
use crate::world::World;

/// The measurements, by their number in issue 13 (4, instructions per
/// operation, is `insn_count` under callgrind).
pub const ALL: [u8; 5] = [1, 2, 3, 5, 6];

/// How much work each measurement does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Effort {
    /// Interleaved repetitions of each measurement and its baseline.
    pub reps: usize,
    /// Ping-pong rounds per repetition.
    pub rounds: u64,
    /// Messages per message-rate repetition.
    pub messages: u64,
    /// 1 MiB writes per bandwidth repetition.
    pub writes: usize,
    /// Create+destroy pairs per control-path repetition.
    pub cycles: usize,
    /// QPs the scale measurement creates.
    pub qps: usize,
    /// Post-and-polls per scale repetition.
    pub ops: u64,
}

impl Effort {
    /// The full run, or the quick one that checks the harness (`quick`).
    pub fn new(quick: bool) -> Self {
        if quick {
            Self {
                reps: 3,
                rounds: 2_000,
                messages: 20_000,
                writes: 4,
                cycles: 50,
                qps: 2 * scale::BLOCK,
                ops: 2_000,
            }
        } else {
            Self {
                reps: 9,
                rounds: 50_000,
                messages: 1_000_000,
                writes: 64,
                cycles: 500,
                qps: 65_536,
                ops: 20_000,
            }
        }
    }

    /// The least work that still runs every code path (the default
    /// suite's smoke test).
    pub fn smoke() -> Self {
        Self {
            reps: 1,
            rounds: 50,
            messages: 256,
            writes: 1,
            cycles: 3,
            qps: scale::BLOCK,
            ops: 20,
        }
    }
}

/// Doorbell batch of measurement 2.
pub const BATCH: usize = 32;
/// Bytes of measurement 3's writes.
pub const MIB: usize = 1 << 20;

/// Measurement 1.
pub fn latency(world: &World, effort: Effort) -> Vec<Line> {
    let shape = Shape {
        qps: 1,
        depth: 64,
        cqe: 256,
        buffer: 4096,
    };
    let (value, base) = with_connection(world, 101, shape, |a, b| {
        user_path::prepare_ping_pong(a, b);
        interleaved(
            effort.reps,
            || user_path::send_ping_pong(a, b, effort.rounds),
            || baseline::cache_line_ping_pong(effort.rounds),
        )
    });
    vec![Line {
        name: "1 latency: 8 B RC send, half round trip".into(),
        value,
        baseline: Some(base),
        unit: "ns",
        baseline_name: "cache-line ping-pong",
        goal: Goal::AtMost(2.0),
    }]
}

/// Measurement 2, with 1 and 8 QPs.
pub fn message_rate(world: &World, effort: Effort) -> Vec<Line> {
    [1usize, 8]
        .into_iter()
        .map(|qps| {
            let shape = Shape {
                qps,
                depth: 4 * BATCH as u32,
                cqe: 1024,
                buffer: 4096,
            };
            let (value, base) = with_connection(world, 110 + qps as u32, shape, |a, b| {
                interleaved(
                    effort.reps,
                    || user_path::write_rate(a, b, effort.messages, BATCH) / 1e6,
                    || baseline::spsc_ring_rate(effort.messages, BATCH as u64) / 1e6,
                )
            });
            Line {
                name: format!("2 rate: 64 B RDMA write, {BATCH}/doorbell, {qps} QP"),
                value,
                baseline: Some(base),
                unit: "Mmsg/s",
                baseline_name: "SPSC ring, same batch",
                goal: Goal::AtLeast(0.5),
            }
        })
        .collect()
}

/// Measurement 3.
pub fn bandwidth(world: &World, effort: Effort) -> Vec<Line> {
    let shape = Shape {
        qps: 1,
        depth: 16,
        cqe: 64,
        buffer: MIB,
    };
    let (value, base) = with_connection(world, 120, shape, |a, b| {
        interleaved(
            effort.reps,
            || user_path::write_bandwidth(a, b, effort.writes) / 1e9,
            || baseline::memcpy_rate(MIB, effort.writes) / 1e9,
        )
    });
    vec![Line {
        name: "3 bandwidth: 1 MiB RDMA write".into(),
        value,
        baseline: Some(base),
        unit: "GB/s",
        baseline_name: "memcpy 1 MiB",
        goal: Goal::AtLeast(0.8),
    }]
}

/// Measurement 5: CQ and QP create+destroy pairs per second through the
/// AL against direct calls of the miniport.
pub fn control_path(world: &World, effort: Effort) -> Vec<Line> {
    let direct = Direct::open(world);
    let al = Al::open(world);
    let (cq_al, cq_direct) = interleaved(
        effort.reps,
        || control::cq_cycles(world, &al, effort.cycles) / 1e3,
        || control::cq_cycles(world, &direct, effort.cycles) / 1e3,
    );
    let al_objects = control::pd_and_cq(world, &al);
    let direct_objects = control::pd_and_cq(world, &direct);
    let (qp_al, qp_direct) = interleaved(
        effort.reps,
        || control::qp_cycles(world, &al, al_objects.0, al_objects.1, effort.cycles) / 1e3,
        || {
            let (pd, cq) = direct_objects;
            control::qp_cycles(world, &direct, pd, cq, effort.cycles) / 1e3
        },
    );
    control::release(world, &al, al_objects);
    control::release(world, &direct, direct_objects);
    al.close(world);
    [("CQ", cq_al, cq_direct), ("QP", qp_al, qp_direct)]
        .into_iter()
        .map(|(what, value, base)| Line {
            name: format!("5 control: {what} create+destroy via AL, DPC"),
            value,
            baseline: Some(base),
            unit: "k/s",
            baseline_name: "direct miniport call",
            goal: Goal::None,
        })
        .collect()
}

/// Measurement 6, on its own machine: the lines and the verifier's
/// findings there.
pub fn scale(effort: Effort) -> (Vec<Line>, Vec<String>) {
    let (s, findings) = scale::run(effort.qps, effort.reps, effort.ops);
    let mut lines = vec![
        Line {
            name: format!("6 scale: create {} QPs, last 1K, per QP", s.qps),
            value: s.last_block_us,
            baseline: Some(s.first_block_us),
            unit: "us",
            baseline_name: "first 1K, per QP",
            goal: Goal::AtMost(1.25),
        },
        Line {
            name: format!("6 scale: create {} QPs, total", s.qps),
            value: s.create_seconds,
            baseline: None,
            unit: "s",
            baseline_name: "",
            goal: Goal::None,
        },
        Line {
            name: format!("6 scale: post+poll with {} QPs live", s.qps),
            value: s.post_poll_many_ns,
            baseline: Some(s.post_poll_few_ns),
            unit: "ns",
            baseline_name: "with 1,024 QPs live",
            goal: Goal::AtMost(1.25),
        },
    ];
    if let Some(bytes) = s.heap_bytes_per_qp {
        lines.push(Line {
            name: "6 scale: heap per QP (whole process)".into(),
            value: bytes / 1024.0,
            baseline: None,
            unit: "KiB",
            baseline_name: "",
            goal: Goal::None,
        });
    }
    (lines, findings)
}

/// Runs the measurements `which` names, printing each line as it is
/// measured: every line, and the verifier's findings on the machines they
/// ran on.
pub fn run(which: &[u8], effort: Effort) -> (Vec<Line>, Vec<String>) {
    let mut lines = Vec::new();
    let mut emit = |new: Vec<Line>| {
        for line in &new {
            println!("{line}");
        }
        lines.extend(new);
    };
    let mut findings = Vec::new();
    if which.iter().any(|m| [1, 2, 3, 5].contains(m)) {
        // A 64K QP table: a destroyed QP's number is reused only after the
        // 2 s TIME WAIT (`QPN_QUIET_PERIOD_NS`), so measurement 5's
        // thousands of create+destroy pairs need that many numbers.
        let world = World::boot(16);
        if which.contains(&1) {
            emit(latency(&world, effort));
        }
        if which.contains(&2) {
            emit(message_rate(&world, effort));
        }
        if which.contains(&3) {
            emit(bandwidth(&world, effort));
        }
        if which.contains(&5) {
            emit(control_path(&world, effort));
        }
        findings.extend(world.finish());
    }
    if which.contains(&6) {
        let (new, found) = scale(effort);
        emit(new);
        findings.extend(found);
    }
    (lines, findings)
}
