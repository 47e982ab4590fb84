//! Issue 13, measurements 1 and 2 at the device level: the simulated HCA's
//! work per small message in fast mode, counted in the doorbell call.
//!
//! Two devices on a [`FastFabric`] with [`SimMemory`], RC QPs connected
//! (path MTU 1024); the driver side is the test kit's. Each workload posts
//! its WQEs outside the measured function, which only rings the send
//! doorbell: in fast mode that store runs the device's send path, the
//! fabric, the peer's receive path, its acknowledgement and the
//! completions, all in the ringing thread. Completions are polled and
//! checked outside it.
//!
//! - `write-batch`: 64-byte inline RDMA writes, 32 per doorbell, the last
//!   one signaled (measurement 2's shape). Per write.
//! - `send`: one signaled 8-byte inline send to a pre-posted receive (its
//!   receive completion, its ACK and its send completion). Per send.
//!
//! ```sh
//! cargo run --release -p sim-hca --example small_messages             # ns per operation
//! cargo run --release -p sim-hca --example small_messages -- callgrind # instructions (valgrind)
//! ```
//!
//! `callgrind` runs this program again under `valgrind --tool=callgrind`
//! for each workload, collecting only inside its `#[inline(never)]`
//! measured function (`--toggle-collect`), and prints instructions per
//! operation; the profiles stay in `target/small-messages/` for
//! `callgrind_annotate --inclusive=yes`. `--wire-path` measures the fabric
//! that keeps every packet a frame ([`FastFabric::new_wire_path`]).

use std::process::Command;
use std::time::Instant;

use ib_types::access::AccessFlags;
use ib_types::qp::QpType;
use ib_types::scalars::Mtu;
use ib_types::wc::WcStatus;
use ib_types::wr::{RemoteAddr, SendFlags, SendOp, SendWr};
use sim_hca::fast::FastFabric;
use sim_hca::testkit::{Cq, Driver, Mr, Qp};
use sim_hca::testkit::{PAIR_IPS as IPS, fast_pair};

const PD: u32 = 3;
/// Writes per doorbell in `write-batch`.
const BATCH: usize = 32;
/// Unmeasured rounds first (buffer pools fill, rings wrap once).
const WARM_UP: usize = 64;

struct Node {
    drv: Driver,
    cq: Cq,
    qp: Qp,
    mr: Mr,
}

fn setup(direct: bool) -> (FastFabric, Node, Node) {
    let (fabric, mems) = fast_pair(direct, |mem| mem);
    let mut nodes = Vec::new();
    for (i, mem) in mems.iter().enumerate() {
        let mem = mem.clone();
        nodes.push(fabric.with_device(i, |dev| {
            let mut drv = Driver::bring_up(dev, mem);
            let cq = drv.create_cq(dev, 10).unwrap();
            let qp = drv
                .create_qp(dev, QpType::Rc, 1, PD, &cq, &cq, None, (8, 8))
                .unwrap();
            let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
            let mr = drv.reg_mr(dev, 1 << 16, PD, access).unwrap();
            Node { drv, cq, qp, mr }
        }));
    }
    let qpns = [nodes[0].qp.qpn, nodes[1].qp.qpn];
    for (i, n) in nodes.iter_mut().enumerate() {
        fabric
            .with_device(i, |dev| {
                n.drv
                    .connect(dev, &n.qp, IPS[1 - i], qpns[1 - i], Mtu::Mtu1024)
            })
            .unwrap();
    }
    let rx = nodes.pop().unwrap();
    let tx = nodes.pop().unwrap();
    (fabric, tx, rx)
}

/// The measured doorbell: everything the device and the fabric do for it.
#[inline(never)]
fn measured_write_doorbell(fabric: &FastFabric, node: &Node) {
    fabric.with_device(0, |dev| node.drv.ring_sq(dev, &node.qp));
}

/// The measured doorbell of one send.
#[inline(never)]
fn measured_send_doorbell(fabric: &FastFabric, node: &Node) {
    fabric.with_device(0, |dev| node.drv.ring_sq(dev, &node.qp));
}

/// Posts one batch of 64-byte inline writes (the last signaled) without
/// ringing; the payload of write `k` is filled with `tag + k`.
fn post_write_batch(fabric: &FastFabric, tx: &mut Node, remote: RemoteAddr, tag: u8) {
    for k in 0..BATCH {
        let data = [tag.wrapping_add(k as u8); 64];
        let sg = [Driver::sge(&tx.mr, 0, 64)];
        let mut flags = SendFlags::INLINE;
        if k == BATCH - 1 {
            flags |= SendFlags::SIGNALED;
        }
        let wr = SendWr {
            wr_id: k as u64,
            op: SendOp::RdmaWrite {
                remote: RemoteAddr {
                    addr: remote.addr + 64 * k as u64,
                    rkey: remote.rkey,
                },
            },
            flags,
            sg_list: &sg,
            ud: None,
        };
        let Node { drv, qp, .. } = tx;
        fabric
            .with_device(0, |dev| {
                drv.post_send(dev, qp, &wr, None, Some(&data), false)
            })
            .unwrap();
    }
}

/// Polls the batch's one completion and checks the last write landed.
fn check_write_batch(tx: &mut Node, rx: &Node, tag: u8) {
    let cqe = tx.drv.poll_cq(&mut tx.cq).expect("the batch completed");
    assert_eq!(cqe.status, WcStatus::Success.code());
    assert!(tx.drv.poll_cq(&mut tx.cq).is_none(), "one completion");
    let last = rx.drv.read_mr(&rx.mr, 64 * (BATCH - 1), 64);
    assert_eq!(last, [tag.wrapping_add(BATCH as u8 - 1); 64]);
}

/// `rounds` doorbells of 32 writes each; returns writes measured.
fn write_batch(direct: bool, rounds: usize) -> usize {
    let (fabric, mut tx, rx) = setup(direct);
    let remote = RemoteAddr {
        addr: rx.mr.va,
        rkey: rx.mr.rkey,
    };
    for round in 0..WARM_UP + rounds {
        let tag = round as u8;
        post_write_batch(&fabric, &mut tx, remote, tag);
        if round < WARM_UP {
            fabric.with_device(0, |dev| tx.drv.ring_sq(dev, &tx.qp));
        } else {
            measured_write_doorbell(&fabric, &tx);
        }
        check_write_batch(&mut tx, &rx, tag);
    }
    rounds * BATCH
}

/// `rounds` signaled 8-byte inline sends, each to a receive posted before
/// it; returns sends measured.
fn send(direct: bool, rounds: usize) -> usize {
    let (fabric, mut tx, mut rx) = setup(direct);
    for round in 0..WARM_UP + rounds {
        let recv_sge = Driver::sge(&rx.mr, 0, 64);
        rx.drv.post_recv(&mut rx.qp, round as u64, &[recv_sge]);
        let data = (round as u64).to_le_bytes();
        let sg = [Driver::sge(&tx.mr, 0, 8)];
        let wr = SendWr {
            wr_id: round as u64,
            op: SendOp::Send,
            flags: SendFlags::INLINE | SendFlags::SIGNALED,
            sg_list: &sg,
            ud: None,
        };
        {
            let Node { drv, qp, .. } = &mut tx;
            fabric
                .with_device(0, |dev| {
                    drv.post_send(dev, qp, &wr, None, Some(&data), false)
                })
                .unwrap();
        }
        if round < WARM_UP {
            fabric.with_device(0, |dev| tx.drv.ring_sq(dev, &tx.qp));
        } else {
            measured_send_doorbell(&fabric, &tx);
        }
        let sent = tx.drv.poll_cq(&mut tx.cq).expect("the send completed");
        assert_eq!(sent.status, WcStatus::Success.code());
        let got = rx.drv.poll_cq(&mut rx.cq).expect("the receive completed");
        assert_eq!(got.status, WcStatus::Success.code());
        assert_eq!(rx.drv.read_mr(&rx.mr, 0, 8), data);
    }
    rounds
}

type Workload = (&'static str, &'static str, fn(bool, usize) -> usize);

const WORKLOADS: [Workload; 2] = [
    ("write-batch", "measured_write_doorbell", write_batch),
    ("send", "measured_send_doorbell", send),
];

/// Total instructions of a callgrind output file (its `summary:` or
/// `totals:` line).
fn callgrind_total(path: &std::path::Path) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines()
        .rev()
        .find_map(|l| l.strip_prefix("summary:").or(l.strip_prefix("totals:")))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let direct = !args.iter().any(|a| a == "--wire-path");
    let path = if direct { "direct" } else { "wire path" };
    if args.iter().any(|a| a == "callgrind") {
        let exe = std::env::current_exe().expect("own path");
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/small-messages");
        std::fs::create_dir_all(&dir).expect("output directory");
        for (name, function, _) in WORKLOADS {
            let out = dir.join(format!(
                "callgrind.{name}.{}",
                if direct { "direct" } else { "wire" }
            ));
            let mut cmd = Command::new("valgrind");
            cmd.arg("--tool=callgrind")
                .arg(format!("--toggle-collect=small_messages::{function}"))
                .arg(format!("--callgrind-out-file={}", out.display()))
                .arg(&exe)
                .arg("--run")
                .arg(name);
            if !direct {
                cmd.arg("--wire-path");
            }
            let status = cmd.output().expect("valgrind runs").status;
            assert!(status.success(), "{name} under valgrind: {status}");
            let total = callgrind_total(&out).expect("a callgrind total");
            let ops = RUN_ROUNDS * if name == "write-batch" { BATCH } else { 1 };
            println!(
                "{name:12} ({path}): {} instructions per operation ({total} / {ops})",
                total / ops as u64
            );
        }
        return;
    }
    if let Some(at) = args.iter().position(|a| a == "--run") {
        let name = &args[at + 1];
        let (_, _, run) = WORKLOADS
            .iter()
            .find(|(n, _, _)| n == name)
            .expect("a workload name");
        run(direct, RUN_ROUNDS);
        return;
    }
    for (name, _, run) in WORKLOADS {
        let t = Instant::now();
        let ops = run(direct, 2000);
        let ns = t.elapsed().as_nanos() as f64 / ops as f64;
        println!("{name:12} ({path}): {ns:.0} ns per operation, set-up and checks included");
    }
}

/// Measured rounds of a callgrind run.
const RUN_ROUNDS: usize = 200;
