//! Measurement 6: scale. A kernel client fills HCA 0's QP table (65,536
//! QPs, a 2^17 table) through the miniport's request path at
//! DISPATCH_LEVEL, a window of requests in flight as a busy client keeps
//! them; it times each block of 1,024 creates, counts the heap bytes the
//! QPs hold (the whole process: drivers, simulated host and device), and
//! times a direct post (64-byte inline RDMA write) plus its poll on a
//! connected RC QP with 1,024 and with 65,536 QPs live.

use std::collections::VecDeque;
use std::time::Instant;

use hca_miniport_core::init::HcaConfig;
use hca_miniport_core::verbs::qp::SendRequest;
use ib_types::access::AccessFlags;
use ib_types::cq::CqAttr;
use ib_types::handle::{CqHandle, PdHandle};
use ib_types::ioctl::{AllocPd, CreateCq, CreateQp, DeregMr, Empty, ModifyQp, RegMr};
use ib_types::mr::MrRegister;
use ib_types::qp::{QpCaps, QpCreate, QpType};
use ib_types::scalars::{Gid, PortNum, Qpn};
use ib_types::status::IbStatus;
use ib_types::wc::{WcStatus, WorkCompletion};
use ib_types::wr::{LKey, RKey, RemoteAddr, SendFlags, SendOp, SendWr, Sge};
use sim_host::memory::PoolBlock;
use sim_shells::hca_miniport::SERVICE;
use sim_shells::rc_path::{rc_qp_create, rc_to_rts_steps};

use crate::alloc_count;
use crate::kernel::{self, at_dispatch};
use crate::report::median;
use crate::world::{World, port_ip};

/// Creates kept in flight.
const WINDOW: usize = 8;
/// Creates per timed block.
pub const BLOCK: usize = 1024;
/// QPs per CQ: each has one send and one receive WR, and a CQ never takes
/// more work-queue entries than it holds (guide 8.2.3 item 1).
const QPS_PER_CQ: usize = 16_000;

/// What measurement 6 found.
#[derive(Debug, Clone, PartialEq)]
pub struct Scale {
    /// QPs created.
    pub qps: usize,
    /// Seconds to create them all.
    pub create_seconds: f64,
    /// Microseconds per create in the first block of [`BLOCK`].
    pub first_block_us: f64,
    /// Microseconds per create in the last block.
    pub last_block_us: f64,
    /// Heap bytes per QP, when the binary counts the heap.
    pub heap_bytes_per_qp: Option<f64>,
    /// Nanoseconds per post plus poll with [`BLOCK`] QPs live (median).
    pub post_poll_few_ns: f64,
    /// The same with all the QPs live.
    pub post_poll_many_ns: f64,
}

/// A filler QP: UD, one WR each way, on `cq`.
fn filler(pd: u64, cq: u64) -> QpCreate {
    QpCreate {
        qp_type: QpType::Ud,
        pd: PdHandle::from_raw(pd),
        send_cq: CqHandle::from_raw(cq),
        recv_cq: CqHandle::from_raw(cq),
        srq: None,
        caps: QpCaps {
            max_send_wr: 1,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        sq_sig_all: false,
        port: None,
    }
}

/// The probe: an RC QP on HCA 0 connected to one on HCA 1, which grants
/// remote write to a registered kernel buffer.
struct Probe {
    qp: u64,
    cq: u64,
    remote: u64,
    rkey: RKey,
    /// HCA 1's buffer and its registration.
    block: PoolBlock,
    mr: u64,
}

impl Probe {
    /// Deregisters and frees HCA 1's buffer (the rest goes with the
    /// machine's shutdown).
    fn release(self, world: &World) {
        kernel::call::<DeregMr>(world, 1, self.mr, &Empty);
        world.host.pool().free(self.block);
    }
}

/// HCA `at`'s kernel CA and a new PD on it: (CA, PD).
fn open(world: &World, at: usize) -> (u64, u64) {
    let ca = world.kernel_ca(at);
    let (pd, _) = kernel::call::<AllocPd>(world, at, ca, &Empty);
    (ca, pd)
}

fn probe(world: &World, a: (u64, u64), b: (u64, u64)) -> Probe {
    let attr = CqAttr {
        cqe: 256,
        comp_vector: 0,
    };
    let mut qpns = [0u32; 2];
    let mut qps = [0u64; 2];
    let mut cqs = [0u64; 2];
    for (at, (ca, pd)) in [a, b].into_iter().enumerate() {
        let (cq, _) = kernel::call::<CreateCq>(world, at, ca, &attr);
        let mut create = rc_qp_create(QpType::Rc, pd, cq, 64);
        create.caps.max_inline_data = 64;
        let (qp, out) = kernel::call::<CreateQp>(world, at, ca, &create);
        qpns[at] = out.expect("CreateQp's output").qpn.get();
        qps[at] = qp;
        cqs[at] = cq;
    }
    for at in 0..2 {
        let steps = rc_to_rts_steps(
            PortNum::new(1).unwrap(),
            AccessFlags::REMOTE_WRITE,
            Qpn::new(qpns[1 - at]).unwrap(),
            Gid::from_ipv4(port_ip(1 - at, 1)),
            1,
        );
        for step in &steps {
            kernel::call::<ModifyQp>(world, at, qps[at], step);
        }
    }
    let block = world
        .host
        .pool()
        .alloc(SERVICE, *b"Bnch", 4096)
        .expect("a pool block");
    let register = MrRegister {
        vaddr: block.va(),
        length: 4096,
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
    };
    let (mr, keys) = kernel::call::<RegMr>(world, 1, b.1, &register);
    Probe {
        qp: qps[0],
        cq: cqs[0],
        remote: block.va(),
        rkey: keys.expect("RegMr's keys").rkey,
        block,
        mr,
    }
}

/// `ops` direct posts of a 64-byte inline RDMA write through the probe,
/// each polled to its completion: nanoseconds per post plus poll.
fn post_poll(world: &World, probe: &Probe, ops: u64) -> f64 {
    let hca = world.hca(0);
    let payload = [0x5Au8; 64];
    let sge = [Sge::new(0, 64, LKey::new(0))];
    let mut wcs = [WorkCompletion::EMPTY; 4];
    let started = Instant::now();
    for i in 0..ops {
        let send = SendRequest {
            wr: SendWr {
                wr_id: i,
                op: SendOp::RdmaWrite {
                    remote: RemoteAddr {
                        addr: probe.remote,
                        rkey: probe.rkey,
                    },
                },
                flags: SendFlags::INLINE | SendFlags::SIGNALED,
                sg_list: &sge,
                ud: None,
            },
            av: None,
            inline: Some(&payload),
        };
        let posted = at_dispatch(world, || hca.post_send(probe.qp, &[send]));
        assert_eq!(posted, (1, IbStatus::Success));
        crate::spin::until(|| {
            let n = at_dispatch(world, || hca.poll_cq(probe.cq, &mut wcs)).expect("poll");
            if n > 0 {
                assert_eq!(wcs[0].status, WcStatus::Success, "{:?}", wcs[0]);
            }
            n > 0
        });
    }
    started.elapsed().as_secs_f64() * 1e9 / ops as f64
}

/// Runs measurement 6 with `qps` filler QPs, `reps` medians of `ops`
/// post-and-polls at each point, on its own machine (a 2^17 QP table).
/// Returns the findings and the verifier's.
pub fn run(qps: usize, reps: usize, ops: u64) -> (Scale, Vec<String>) {
    let config = HcaConfig {
        max_log_qps: 17,
        max_context_bytes: 256 << 20,
        ..HcaConfig::default()
    };
    let world = World::boot_with(17, config);
    let a = open(&world, 0);
    let b = open(&world, 1);
    let probe = probe(&world, a, b);
    let (ca, pd) = a;
    let mut in_flight = VecDeque::new();
    let mut input = None;
    let mut block_started = Instant::now();
    let mut block_us = Vec::new();
    let mut few = Vec::new();
    let heap_before = alloc_count::live_bytes();
    let started = Instant::now();
    for index in 0..qps {
        if index % QPS_PER_CQ == 0 {
            let attr = CqAttr {
                cqe: 2 * QPS_PER_CQ as u32,
                comp_vector: 0,
            };
            input = Some(filler(pd, kernel::call::<CreateCq>(&world, 0, ca, &attr).0));
        }
        if in_flight.len() == WINDOW {
            let issuer: sim_host::request::RequestHandle =
                in_flight.pop_front().expect("the window is full");
            kernel::ok::<CreateQp>(&kernel::wait(&issuer, "CreateQp"));
        }
        let create = input.as_ref().expect("a CQ for this batch");
        in_flight.push_back(kernel::submit::<CreateQp>(&world, 0, ca, create));
        if (index + 1) % BLOCK == 0 {
            for issuer in in_flight.drain(..) {
                kernel::ok::<CreateQp>(&kernel::wait(&issuer, "CreateQp"));
            }
            block_us.push(block_started.elapsed().as_secs_f64() * 1e6 / BLOCK as f64);
            if index + 1 == BLOCK {
                // The cost at few live QPs, outside the timed creates.
                few = (0..reps).map(|_| post_poll(&world, &probe, ops)).collect();
            }
            block_started = Instant::now();
        }
    }
    for issuer in in_flight.drain(..) {
        kernel::ok::<CreateQp>(&kernel::wait(&issuer, "CreateQp"));
    }
    let create_seconds = started.elapsed().as_secs_f64();
    let heap_after = alloc_count::live_bytes();
    let mut many: Vec<f64> = (0..reps).map(|_| post_poll(&world, &probe, ops)).collect();
    let heap_bytes_per_qp = heap_before
        .zip(heap_after)
        .map(|(before, after)| (after - before) as f64 / qps as f64);
    let scale = Scale {
        qps,
        create_seconds,
        first_block_us: block_us.first().copied().unwrap_or(f64::NAN),
        last_block_us: block_us.last().copied().unwrap_or(f64::NAN),
        heap_bytes_per_qp,
        post_poll_few_ns: median(&mut few),
        post_poll_many_ns: median(&mut many),
    };
    probe.release(&world);
    (scale, world.finish())
}
