//! Scenarios under load on the deterministic host, each over several seeds
//! (each seed is another interleaving of DPCs, work items and the device):
//! a CQ resized while completions keep arriving; an RC QP moved to ERR and
//! to RESET with work outstanding, then reconnected; far more concurrent
//! verbs than command slots, and the same when the device stops
//! answering. Data is checked byte for byte; every test ends with the host
//! shut down and the verifier clean.

mod support;

use std::sync::{Arc, Mutex};

use driver_platform::RequestorMode;
use ib_types::access::AccessFlags;
use ib_types::cq::CqAttr;
use ib_types::handle::{CqHandle, PdHandle};
use ib_types::ioctl::{
    AllocPd, CloseCa, CreateCq, CreateQp, DeallocPd, DeregMr, DestroyCq, DestroyQp, Empty,
    ModifyQp, OpenCa, OpenCaIn, QueryCq, QueryQp, RegMr, ResizeCq, Verb,
};
use ib_types::mr::{MrKeys, MrRegister};
use ib_types::qp::{QpCaps, QpCreate, QpModify, QpState, QpType};
use ib_types::status::IbStatus;
use ib_types::wc::{WcOpcode, WcStatus, WorkCompletion};
use ib_types::wr::{RemoteAddr, SendFlags, SendOp, SendWr, Sge};
use sim_host::memory::PoolBlock;
use sim_host::request::RequestHandle;
use support::rc_path::rc_to_rts_steps;
use support::{World, lock, response};

const KERNEL: RequestorMode = RequestorMode::Kernel;
const SEEDS: [u64; 6] = [3, 17, 29, 1234, 40, 65];
const PORT_IPS: [[u8; 4]; 2] = [[10, 0, 0, 1], [10, 0, 1, 1]];

/// Bytes per RDMA write.
const MSG: usize = 32;
/// Write slots in the target area.
const SLOTS: usize = 128;

fn call<V: Verb>(w: &World, handle: u64, input: &V::In) -> (u64, Option<V::Out>) {
    let done = w.call_in_dpc::<V>(KERNEL, handle, input, 0);
    let r = response::<V>(&done);
    assert_eq!(r.status, IbStatus::Success, "{}", V::ID.name());
    (r.handle, r.output)
}

fn pattern(tag: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (tag as u8).wrapping_mul(37) ^ (i as u8).wrapping_mul(11) ^ (tag >> 8) as u8)
        .collect()
}

/// One HCA, an RC QP on each port connected to the other, each with its
/// own CQ; `a` writes into `b`'s registered memory.
struct Rig {
    w: World,
    ca: u64,
    pd: u64,
    cq_a: u64,
    cq_b: u64,
    a: u64,
    b: u64,
    qpn_a: u32,
    qpn_b: u32,
    source: PoolBlock,
    target: PoolBlock,
    mrs: [u64; 2],
    keys: [MrKeys; 2],
    /// Next `wr_id` to post on `a`.
    next: u64,
}

impl Rig {
    fn new(seed: u64, cqe: u32) -> Self {
        let w = World::deterministic(seed);
        let (ca, _) = call::<OpenCa>(&w, 0, &OpenCaIn::CURRENT);
        let (pd, _) = call::<AllocPd>(&w, ca, &Empty);
        let attr = CqAttr {
            cqe,
            comp_vector: 0,
        };
        let (cq_a, _) = call::<CreateCq>(&w, ca, &attr);
        let (cq_b, _) = call::<CreateCq>(&w, ca, &attr);
        let qp = |cq: u64| QpCreate {
            qp_type: QpType::Rc,
            pd: PdHandle::from_raw(pd),
            send_cq: CqHandle::from_raw(cq),
            recv_cq: CqHandle::from_raw(cq),
            srq: None,
            caps: QpCaps {
                max_send_wr: 64,
                max_recv_wr: 4,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            sq_sig_all: false,
            port: None,
        };
        let (a, created_a) = call::<CreateQp>(&w, ca, &qp(cq_a));
        let (b, created_b) = call::<CreateQp>(&w, ca, &qp(cq_b));
        let mut blocks = Vec::new();
        let mut mrs = [0; 2];
        let mut keys = [MrKeys::default(); 2];
        for k in 0..2 {
            let block = w
                .host
                .pool()
                .alloc(support::DRIVER, *b"Strs", SLOTS * MSG)
                .unwrap();
            let reg = MrRegister {
                vaddr: block.va(),
                length: (SLOTS * MSG) as u64,
                access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
            };
            let (mr, k_out) = call::<RegMr>(&w, pd, &reg);
            mrs[k] = mr;
            keys[k] = k_out.unwrap();
            blocks.push(block);
        }
        let target = blocks.pop().unwrap();
        let source = blocks.pop().unwrap();
        let rig = Rig {
            w,
            ca,
            pd,
            cq_a,
            cq_b,
            a,
            b,
            qpn_a: created_a.unwrap().qpn.get(),
            qpn_b: created_b.unwrap().qpn.get(),
            source,
            target,
            mrs,
            keys,
            next: 0,
        };
        rig.connect_both();
        rig
    }

    /// RESET to RTS on both QPs (each on its own port, towards the other).
    fn connect_both(&self) {
        self.connect(self.a, 1, self.qpn_b, PORT_IPS[1]);
        self.connect(self.b, 2, self.qpn_a, PORT_IPS[0]);
    }

    fn connect(&self, qp: u64, port: u8, dest: u32, dest_ip: [u8; 4]) {
        let steps = rc_to_rts_steps(port, AccessFlags::REMOTE_WRITE, dest, dest_ip, 4);
        for m in steps {
            call::<ModifyQp>(&self.w, qp, &m);
        }
    }

    /// `count` signaled RDMA writes from `a`, numbered from `self.next`,
    /// each writing `pattern(wr_id)` to slot `wr_id % SLOTS`. Returns them
    /// (to be posted from a DPC with [`Self::post_in_dpc`]).
    fn writes(&mut self, count: usize) -> Vec<SendWr<'static>> {
        let mut wrs = Vec::new();
        for _ in 0..count {
            let id = self.next;
            self.next += 1;
            let slot = (id as usize) % SLOTS;
            assert!(self.source.write(slot * MSG, &pattern(id, MSG)));
            let sge: &'static [Sge] = Box::leak(Box::new([Sge::new(
                self.source.va() + (slot * MSG) as u64,
                MSG as u32,
                self.keys[0].lkey,
            )]));
            wrs.push(SendWr {
                wr_id: id,
                op: SendOp::RdmaWrite {
                    remote: RemoteAddr {
                        addr: self.target.va() + (slot * MSG) as u64,
                        rkey: self.keys[1].rkey,
                    },
                },
                flags: SendFlags::SIGNALED,
                sg_list: sge,
                ud: None,
            });
        }
        wrs
    }

    /// Queues a DPC posting `wrs` on `a`; the result lands in the slot
    /// returned once the machine runs.
    fn post_in_dpc(&self, wrs: Vec<SendWr<'static>>) -> Arc<Mutex<Option<(usize, IbStatus)>>> {
        let out = Arc::new(Mutex::new(None));
        let (hca, sink, qp) = (self.w.hca(), out.clone(), self.a);
        self.w.in_dpc(move || {
            let requests = support::plain_sends(&wrs);
            *lock(&sink) = Some(hca.post_send(qp, &requests));
        });
        out
    }

    /// Queues a chain of DPCs, each posting one batch on `a` and then
    /// queueing the next: the batches go out in order while whatever else
    /// is queued (a modify) interleaves with them as the seed decides.
    /// The results land in the returned list, one per batch.
    fn post_chain_in_dpcs(
        &self,
        batches: Vec<Vec<SendWr<'static>>>,
    ) -> Arc<Mutex<Vec<(usize, IbStatus)>>> {
        fn link(
            sched: sim_host::sched::SchedulerHandle,
            hca: Arc<hca_miniport_core::hca::Hca<sim_host::platform::SimPlatform>>,
            qp: u64,
            mut batches: std::collections::VecDeque<Vec<SendWr<'static>>>,
            out: Arc<Mutex<Vec<(usize, IbStatus)>>>,
        ) {
            let Some(batch) = batches.pop_front() else {
                return;
            };
            let next = sched.clone();
            sched.queue_dpc(support::DRIVER, move || {
                let requests = support::plain_sends(&batch);
                lock(&out).push(hca.post_send(qp, &requests));
                link(next, hca, qp, batches, out);
            });
        }
        let out = Arc::new(Mutex::new(Vec::new()));
        link(
            self.w.host.scheduler_handle(),
            self.w.hca(),
            self.a,
            batches.into(),
            out.clone(),
        );
        out
    }

    /// Queues a DPC submitting `V` (without running the machine).
    /// Ten signaled writes, completed; then 40 more in 8 batches from a
    /// chain of DPCs with a modify of `a` to `state` submitted after a
    /// seed-chosen number of host steps. Returns each batch's answer and
    /// the modify's issuer once everything ran.
    fn modify_during_traffic(
        &mut self,
        seed: u64,
        state: QpState,
    ) -> (Vec<(usize, IbStatus)>, RequestHandle) {
        let wrs = self.writes(10);
        let posted = self.post_in_dpc(wrs);
        self.w.settle();
        assert_eq!(lock(&posted).take(), Some((10, IbStatus::Success)));
        let batches = (0..8).map(|_| self.writes(5)).collect();
        let posted = self.post_chain_in_dpcs(batches);
        run_steps(&self.w, ((seed * 7) % 25) as usize);
        let modify = self.submit_in_dpc::<ModifyQp>(self.a, &QpModify::to_state(state));
        self.w.settle();
        let posted = lock(&posted).clone();
        (posted, modify)
    }

    fn submit_in_dpc<V: Verb>(&self, handle: u64, input: &V::In) -> RequestHandle {
        let (request, issuer) = self.w.request::<V>(KERNEL, handle, input, 0);
        let hca = self.w.hca();
        self.w.in_dpc(move || hca.submit_request(request));
        issuer
    }

    /// Queues a DPC polling `cq` dry into `into`.
    fn poll_in_dpc(&self, cq: u64, into: &Arc<Mutex<Vec<WorkCompletion>>>) {
        let (hca, sink) = (self.w.hca(), into.clone());
        self.w.in_dpc(move || {
            let mut wcs = [WorkCompletion::EMPTY; 8];
            while let Ok(n) = hca.poll_cq(cq, &mut wcs) {
                if n == 0 {
                    break;
                }
                lock(&sink).extend_from_slice(&wcs[..n]);
            }
        });
    }

    fn poll_all(&self, cq: u64) -> Vec<WorkCompletion> {
        let out = Arc::new(Mutex::new(Vec::new()));
        self.poll_in_dpc(cq, &out);
        self.w.settle();
        lock(&out).clone()
    }

    /// The bytes of target slot `slot`.
    fn target_slot(&self, slot: usize) -> Vec<u8> {
        let mut out = vec![0; MSG];
        assert!(self.target.read(slot * MSG, &mut out));
        out
    }

    fn cq_size(&self, cq: u64) -> u32 {
        call::<QueryCq>(&self.w, cq, &Empty).1.unwrap().cqe
    }

    fn state(&self, qp: u64) -> QpState {
        call::<QueryQp>(&self.w, qp, &Empty).1.unwrap().state
    }

    fn finish(self) {
        let w = &self.w;
        for qp in [self.a, self.b] {
            call::<DestroyQp>(w, qp, &Empty);
        }
        for mr in self.mrs {
            call::<DeregMr>(w, mr, &Empty);
        }
        for cq in [self.cq_a, self.cq_b] {
            call::<DestroyCq>(w, cq, &Empty);
        }
        call::<DeallocPd>(w, self.pd, &Empty);
        call::<CloseCa>(w, self.ca, &Empty);
        w.host.pool().free(self.source);
        w.host.pool().free(self.target);
        self.w.finish();
    }
}

/// Checks that `wcs` are successful RDMA writes with `wr_id`s `ids` in
/// order, and that each one's target slot holds its bytes (the last
/// write to each slot).
fn check_writes(rig: &Rig, wcs: &[WorkCompletion], ids: std::ops::Range<u64>) {
    let got: Vec<u64> = wcs.iter().map(|wc| wc.wr_id).collect();
    assert_eq!(
        got,
        ids.clone().collect::<Vec<_>>(),
        "each wr_id once, in order"
    );
    for wc in wcs {
        assert_eq!(
            (wc.status, wc.opcode),
            (WcStatus::Success, WcOpcode::RdmaWrite),
            "{wc:?}"
        );
        assert_eq!(wc.qp_num.get(), rig.qpn_a);
    }
    for id in ids.clone() {
        if id + (SLOTS as u64) >= ids.end {
            let slot = (id as usize) % SLOTS;
            assert_eq!(rig.target_slot(slot), pattern(id, MSG), "write {id}");
        }
    }
}

fn resize_under_traffic(seed: u64) {
    // 128 entries: the QP's queues need 68 (64 sends, 4 receives), and a
    // CQ smaller than that is refused (guide 8.2.3 item 1, `cq::Room`).
    let mut rig = Rig::new(seed, 128);
    let mut polled: Vec<WorkCompletion> = Vec::new();
    let old = rig.cq_size(rig.cq_a);
    assert_eq!(old, 128);
    // Grow, shrink to a size that fits, shrink to the original: each
    // resize issued while a batch of writes is being executed and a
    // poller runs, all as DPCs the scheduler interleaves.
    for (round, size) in [512u32, 256, 128, 200].into_iter().enumerate() {
        let wrs = rig.writes(48);
        let posted = rig.post_in_dpc(wrs);
        let resize = rig.submit_in_dpc::<ResizeCq>(
            rig.cq_a,
            &CqAttr {
                cqe: size,
                comp_vector: 0,
            },
        );
        let during = Arc::new(Mutex::new(Vec::new()));
        rig.poll_in_dpc(rig.cq_a, &during);
        rig.w.settle();
        assert_eq!(
            lock(&posted).take(),
            Some((48, IbStatus::Success)),
            "round {round}"
        );
        let done = resize.completion().expect("the resize completed");
        let r = response::<ResizeCq>(&done);
        assert_eq!(
            r.status,
            IbStatus::Success,
            "round {round}: resize to {size}"
        );
        let granted = r.output.unwrap().cqe;
        assert!(
            granted >= size && granted < 2 * size,
            "{granted} for {size}"
        );
        assert_eq!(rig.cq_size(rig.cq_a), granted);
        polled.extend(lock(&during).iter().copied());
        polled.extend(rig.poll_all(rig.cq_a));
        check_writes(&rig, &polled, 0..rig.next);
    }

    // A shrink that cannot fit: 48 completions wait in the CQ, the resize
    // asks for 16 while 8 more writes run. Refused (less than the QP's
    // work queues) with the old ring intact: every completion is still
    // there, in order.
    let before = rig.cq_size(rig.cq_a);
    let first = rig.next;
    let wrs = rig.writes(48);
    let posted = rig.post_in_dpc(wrs);
    rig.w.settle();
    assert_eq!(lock(&posted).take(), Some((48, IbStatus::Success)));
    let wrs = rig.writes(8);
    let posted = rig.post_in_dpc(wrs);
    let resize = rig.submit_in_dpc::<ResizeCq>(
        rig.cq_a,
        &CqAttr {
            cqe: 16,
            comp_vector: 0,
        },
    );
    rig.w.settle();
    assert_eq!(lock(&posted).take(), Some((8, IbStatus::Success)));
    let done = resize.completion().expect("the resize completed");
    assert_eq!(response::<ResizeCq>(&done).status, IbStatus::InvalidCqSize);
    assert_eq!(rig.cq_size(rig.cq_a), before);
    let rest = rig.poll_all(rig.cq_a);
    check_writes(&rig, &rest, first..rig.next);
    // The CQ still works: more traffic after the refusal.
    let first = rig.next;
    let wrs = rig.writes(20);
    let posted = rig.post_in_dpc(wrs);
    rig.w.settle();
    assert_eq!(lock(&posted).take(), Some((20, IbStatus::Success)));
    check_writes(&rig, &rig.poll_all(rig.cq_a), first..rig.next);
    assert!(rig.poll_all(rig.cq_b).is_empty());
    rig.finish();
}

#[test]
fn a_cq_resized_under_traffic_loses_duplicates_and_reorders_nothing() {
    for seed in SEEDS {
        resize_under_traffic(seed);
    }
}

/// Runs `steps` items of the machine.
fn run_steps(w: &World, steps: usize) {
    for _ in 0..steps {
        w.host.scheduler().run_one().unwrap();
    }
}

/// Moves both QPs back through RESET and reconnects them.
fn reconnect(rig: &Rig) {
    for qp in [rig.a, rig.b] {
        if rig.state(qp) != QpState::Reset {
            call::<ModifyQp>(&rig.w, qp, &QpModify::to_state(QpState::Reset));
        }
    }
    // Reset after a connection: RTR waits out TIME WAIT (guide 6.5.2).
    rig.w
        .host
        .scheduler()
        .advance(hca_miniport_core::verbs::qp::QPN_QUIET_PERIOD_NS)
        .unwrap();
    rig.connect_both();
}

/// Returns how many of the 50 WRs succeeded.
fn err_during_traffic(seed: u64) -> usize {
    let mut rig = Rig::new(seed, 128);
    // Completions already in the CQ before the error, then 40 more while
    // the QP is moved to ERR: the batches before the modify run, those
    // after it are flushed (a QP in ERR takes posts and flushes them,
    // PRM 10.5).
    let (posted, to_err) = rig.modify_during_traffic(seed, QpState::Err);
    assert_eq!(posted, vec![(5, IbStatus::Success); 8]);
    let n = 40;
    assert_eq!(
        response::<ModifyQp>(&to_err.completion().unwrap()).status,
        IbStatus::Success
    );
    assert_eq!(rig.state(rig.a), QpState::Err);
    let wcs = rig.poll_all(rig.cq_a);
    let ids: Vec<u64> = wcs.iter().map(|wc| wc.wr_id).collect();
    assert_eq!(
        ids,
        (0..10 + n as u64).collect::<Vec<_>>(),
        "each wr_id once, in order"
    );
    // A prefix succeeded (at least the first 10), the rest flushed.
    let ok = wcs
        .iter()
        .take_while(|wc| wc.status == WcStatus::Success)
        .count();
    assert!(ok >= 10);
    assert!(
        wcs[ok..].iter().all(|wc| wc.status == WcStatus::WrFlushErr),
        "{wcs:?}"
    );
    check_writes(&rig, &wcs[..ok], 0..ok as u64);
    // Reconnect; traffic resumes with new ids.
    reconnect(&rig);
    rig.next = 1000;
    let wrs = rig.writes(30);
    let posted = rig.post_in_dpc(wrs);
    rig.w.settle();
    assert_eq!(lock(&posted).take(), Some((30, IbStatus::Success)));
    check_writes(&rig, &rig.poll_all(rig.cq_a), 1000..1030);
    rig.finish();
    ok
}

#[test]
fn err_with_work_outstanding_flushes_every_wr_once_and_the_qp_reconnects() {
    let succeeded: Vec<usize> = SEEDS.into_iter().map(err_during_traffic).collect();
    // The seeds cover both a modify that overtook the traffic and one
    // that came after it.
    assert!(succeeded.iter().any(|&ok| ok < 50), "{succeeded:?}");
    assert!(succeeded.iter().any(|&ok| ok > 10), "{succeeded:?}");
}

/// Returns how many old completions were polled.
fn reset_during_traffic(seed: u64) -> usize {
    let mut rig = Rig::new(seed, 128);
    // Completions already in the CQ before the reset stay there, with
    // their wr_ids (guide 6.5.5 item 3); 40 more while the QP is moved to
    // RESET: PRM 6.1.3, outstanding work is discarded without
    // completions; once the reset is answered posts are refused.
    let (posted, to_reset) = rig.modify_during_traffic(seed, QpState::Reset);
    let accepted = posted
        .iter()
        .take_while(|p| **p == (5, IbStatus::Success))
        .count();
    assert!(
        posted[accepted..]
            .iter()
            .all(|p| *p == (0, IbStatus::InvalidQpState)),
        "{posted:?}"
    );
    let n = 5 * accepted;
    assert_eq!(
        response::<ModifyQp>(&to_reset.completion().unwrap()).status,
        IbStatus::Success
    );
    assert_eq!(rig.state(rig.a), QpState::Reset);
    // Reconnect and send new work before polling anything.
    reconnect(&rig);
    // New ids whose slots (64..94) the old writes did not use.
    rig.next = 1088;
    let wrs = rig.writes(30);
    let posted = rig.post_in_dpc(wrs);
    rig.w.settle();
    assert_eq!(lock(&posted).take(), Some((30, IbStatus::Success)));
    let wcs = rig.poll_all(rig.cq_a);
    // Old completions: a prefix of 0..50 (at least the first 10), each
    // once, in order, successful; then the new ones.
    let old = wcs.iter().take_while(|wc| wc.wr_id < 1088).count();
    assert!((10..=10 + n).contains(&old), "{old} old completions");
    check_writes(&rig, &wcs[..old], 0..old as u64);
    check_writes(&rig, &wcs[old..], 1088..1118);
    // And the queue keeps going past its ring size.
    for round in 0..3 {
        let first = rig.next;
        let wrs = rig.writes(60);
        let posted = rig.post_in_dpc(wrs);
        rig.w.settle();
        assert_eq!(
            lock(&posted).take(),
            Some((60, IbStatus::Success)),
            "round {round}"
        );
        check_writes(&rig, &rig.poll_all(rig.cq_a), first..rig.next);
    }
    rig.finish();
    old
}

#[test]
fn reset_with_work_outstanding_keeps_earlier_completions_and_the_qp_reconnects() {
    let old: Vec<usize> = SEEDS.into_iter().map(reset_during_traffic).collect();
    assert!(old.contains(&10), "{old:?}");
    assert!(old.iter().any(|&n| n > 10), "{old:?}");
}
