//! Post and poll on different OS threads: a threaded host (worker threads,
//! two HCAs wired back to back), an RC QP pair, and on each HCA one thread
//! posting sends and RDMA writes in a loop while a second polls the send
//! CQ and a third polls the receive CQ (re-posting receives), both pollers
//! with the guide's 8.3 helper (`poll_and_rearm`) and driven by completion
//! events. Every `wr_id` comes back exactly once and in order, every
//! received byte is checked, the written area holds the last writes.
//! Posts and polls run at DISPATCH_LEVEL inside the miniport's context.
//! Ends with the host shut down and the verifier clean.
//!
//! The same with every interrupt message's DPC queued over and over, so
//! several DPCs of one device run at once on different workers.
//!
//! Then: post and poll take the object tables shared only, and a thread
//! holding them shared delays neither (the reader-writer spin lock).
//!
//! The long soak: `cargo test -p hca-miniport-core --test scenarios_threads
//! -- --ignored`.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use driver_platform::{Irql, RequestorMode};
use hca_miniport_core::hca::Hca;
use hca_miniport_core::verbs::CqNotify;
use hca_miniport_core::verbs::poll_and_rearm;
use hca_miniport_core::verbs::qp::SendRequest;
use ib_types::access::AccessFlags;
use ib_types::cq::CqAttr;
use ib_types::handle::{CqHandle, PdHandle};
use ib_types::ioctl::{
    AllocPd, CloseCa, CreateCq, CreateQp, DeallocPd, DeregMr, DestroyCq, DestroyQp, Empty,
    ModifyQp, OpenCa, OpenCaIn, RegMr, Verb,
};
use ib_types::mr::{MrKeys, MrRegister};
use ib_types::qp::{QpCaps, QpCreate, QpType};
use ib_types::status::IbStatus;
use ib_types::wc::{WcOpcode, WcStatus, WorkCompletion};
use ib_types::wr::{RecvWr, RemoteAddr, SendFlags, SendOp, SendWr, Sge};
use sim_hca::device::DeviceConfig;
use sim_host::context::{self, Context};
use sim_host::irql::IrqlGuard;
use sim_host::memory::PoolBlock;
use sim_host::platform::SimPlatform;
use sim_host::rw_spin_lock::{self, RwAcquisitions};
use support::rc_path::rc_to_rts_steps;
use support::{World, response};

const KERNEL: RequestorMode = RequestorMode::Kernel;

const HCA_IPS: [[[u8; 4]; 2]; 2] = [
    [[10, 0, 0, 1], [10, 0, 1, 1]],
    [[10, 0, 2, 1], [10, 0, 3, 1]],
];
const GUIDS: [u64; 2] = [0x0002_C900_0000_5000, 0x0002_C900_0000_6000];

/// Bytes per message.
const MSG: usize = 64;
/// Message slots in each area of a buffer (send, receive, RDMA-write).
const SLOTS: usize = 64;
/// Work requests a sender keeps outstanding at most.
const WINDOW: u64 = 32;
/// Receives kept posted.
const RECVS: u64 = 32;
/// Areas of a buffer.
const SEND_AREA: usize = 0;
const RECV_AREA: usize = SLOTS * MSG;
const WRITE_AREA: usize = 2 * SLOTS * MSG;
const BUF_BYTES: usize = 3 * SLOTS * MSG;

/// Every fourth WR is an RDMA write, the others sends.
fn is_write(seq: u64) -> bool {
    seq % 4 == 3
}

/// How many sends are among WRs `0..seq`.
fn sends_before(seq: u64) -> u64 {
    seq - seq / 4
}

fn pattern(tag: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (tag as u8).wrapping_mul(31) ^ (i as u8).wrapping_mul(7) ^ (tag >> 8) as u8)
        .collect()
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        thread::yield_now();
    }
}

struct Side {
    i: usize,
    ca: u64,
    pd: u64,
    send_cq: u64,
    recv_cq: u64,
    qp: u64,
    qpn: u32,
    block: Arc<PoolBlock>,
    mr: u64,
    keys: MrKeys,
}

fn call<V: Verb>(w: &World, i: usize, handle: u64, input: &V::In) -> (u64, Option<V::Out>) {
    let done = w.call_in_dpc_waiting_at::<V>(i, KERNEL, handle, input, 0);
    let r = response::<V>(&done);
    assert_eq!(r.status, IbStatus::Success, "{}", V::ID.name());
    (r.handle, r.output)
}

fn side(w: &World, i: usize) -> Side {
    let (ca, _) = call::<OpenCa>(w, i, 0, &OpenCaIn::CURRENT);
    let (pd, _) = call::<AllocPd>(w, i, ca, &Empty);
    let attr = CqAttr {
        cqe: 256,
        comp_vector: 0,
    };
    let (send_cq, _) = call::<CreateCq>(w, i, ca, &attr);
    let (recv_cq, _) = call::<CreateCq>(w, i, ca, &attr);
    let input = QpCreate {
        qp_type: QpType::Rc,
        pd: PdHandle::from_raw(pd),
        send_cq: CqHandle::from_raw(send_cq),
        recv_cq: CqHandle::from_raw(recv_cq),
        srq: None,
        caps: QpCaps {
            max_send_wr: 64,
            max_recv_wr: RECVS as u32,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        sq_sig_all: false,
        port: None,
    };
    let (qp, created) = call::<CreateQp>(w, i, ca, &input);
    let block = w
        .host
        .pool()
        .alloc(support::DRIVER, *b"Thrd", BUF_BYTES)
        .unwrap();
    let reg = MrRegister {
        vaddr: block.va(),
        length: BUF_BYTES as u64,
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
    };
    let (mr, keys) = call::<RegMr>(w, i, pd, &reg);
    Side {
        i,
        ca,
        pd,
        send_cq,
        recv_cq,
        qp,
        qpn: created.unwrap().qpn.get(),
        block: Arc::new(block),
        mr,
        keys: keys.unwrap(),
    }
}

fn connect(w: &World, s: &Side, dest: u32, dest_ip: [u8; 4]) {
    let steps = rc_to_rts_steps(1, AccessFlags::REMOTE_WRITE, dest, dest_ip, 4);
    for m in steps {
        call::<ModifyQp>(w, s.i, s.qp, &m);
    }
}

fn teardown(w: &World, s: Side) {
    call::<DestroyQp>(w, s.i, s.qp, &Empty);
    call::<DeregMr>(w, s.i, s.mr, &Empty);
    call::<DestroyCq>(w, s.i, s.send_cq, &Empty);
    call::<DestroyCq>(w, s.i, s.recv_cq, &Empty);
    call::<DeallocPd>(w, s.i, s.pd, &Empty);
    call::<CloseCa>(w, s.i, s.ca, &Empty);
    let block = Arc::try_unwrap(s.block).expect("the threads are done");
    w.host.pool().free(block);
}

/// Runs `f` as the miniport would run a caller at DISPATCH_LEVEL on this
/// thread: inside the driver's context, at DISPATCH_LEVEL.
fn at_dispatch<R>(w: &World, f: impl FnOnce() -> R) -> R {
    let _context = context::enter(Context::driver(w.host.verifier().clone(), support::DRIVER));
    let _irql = IrqlGuard::at(Irql::DISPATCH);
    f()
}

/// What one direction shares between its threads.
#[derive(Default)]
struct Progress {
    /// Send-side WRs completed (in order).
    sent: AtomicU64,
    /// Receives posted so far (the `wr_id` of the next one).
    recvs_posted: AtomicU64,
    /// Receives completed.
    received: AtomicU64,
    /// A thread failed: the others stop waiting.
    failed: AtomicBool,
}

/// The completion events of CQ `cqn` seen by `sink` from index `*seen`
/// on; advances `*seen`.
fn new_events(sink: &support::CountingSink, cqn: u32, seen: &mut usize) -> usize {
    let events = support::lock(&sink.completions);
    let count = events[*seen..].iter().filter(|&&c| c == cqn).count();
    *seen = events.len();
    count
}

/// Polls `cq` with the 8.3 helper until `total` completions were handed
/// to `process`, waiting for a completion event between rounds.
fn poll_thread(
    w: Arc<World>,
    hca: Arc<Hca<SimPlatform>>,
    i: usize,
    cq: u64,
    total: u64,
    progress: Arc<Progress>,
    mut process: impl FnMut(&WorkCompletion) + Send,
) {
    let sink = w.sink_at(i);
    let cqn = support::number_of(cq);
    let mut seen = 0;
    let mut done = 0u64;
    let mut wcs = [WorkCompletion::EMPTY; 16];
    let mut rounds_woken_by_events = 0u64;
    while done < total {
        // Events recorded before the round are consumed by it.
        new_events(&sink, cqn, &mut seen);
        at_dispatch(&w, || {
            poll_and_rearm(&hca, cq, CqNotify::NextCompletion, &mut wcs, |batch| {
                for wc in batch {
                    process(wc);
                }
                done += batch.len() as u64;
            })
            .unwrap()
        });
        if done >= total {
            break;
        }
        // Armed with nothing left: the next completion raises an event.
        wait_for("a completion event", || {
            progress.failed.load(Ordering::Acquire) || new_events(&sink, cqn, &mut seen) > 0
        });
        assert!(!progress.failed.load(Ordering::Acquire));
        rounds_woken_by_events += 1;
    }
    assert!(rounds_woken_by_events > 0 || total == 0);
}

/// One direction: `from` posts `count` WRs to `to`.
fn direction(w: &Arc<World>, from: &Side, to: &Side, count: u64) -> Vec<thread::JoinHandle<()>> {
    let progress = Arc::new(Progress::default());
    let (hca_from, hca_to) = (w.hca_at(from.i), w.hca_at(to.i));
    let sends = sends_before(count);
    let mut threads = Vec::new();

    // Receiver: pre-post, then poll the receive CQ and re-post.
    let recv_sges: Vec<&'static [Sge]> = (0..RECVS as usize)
        .map(|k| {
            let sge = Sge::new(
                to.block.va() + (RECV_AREA + k * MSG) as u64,
                MSG as u32,
                to.keys.lkey,
            );
            &*Box::leak(Box::new([sge])) as &'static [Sge]
        })
        .collect();
    let post_recv = {
        let (w, hca, qp, progress) = (w.clone(), hca_to.clone(), to.qp, progress.clone());
        move |k: u64| {
            let wr = RecvWr {
                wr_id: k,
                sg_list: recv_sges[(k % RECVS) as usize],
            };
            let posted = at_dispatch(&w, || hca.post_recv(qp, &[wr]));
            assert_eq!(posted, (1, IbStatus::Success));
            progress.recvs_posted.store(k + 1, Ordering::Release);
        }
    };
    for k in 0..RECVS.min(sends) {
        post_recv(k);
    }
    {
        let (w2, hca, i, cq, progress) = (
            w.clone(),
            hca_to.clone(),
            to.i,
            to.recv_cq,
            progress.clone(),
        );
        let block = to.block.clone();
        let qpn = to.qpn;
        threads.push(thread::spawn(move || {
            let mut next = 0u64;
            let p = progress.clone();
            poll_thread(w2, hca, i, cq, sends, progress, |wc| {
                let check = || {
                    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
                    assert_eq!(wc.wr_id, next, "receives in order, each once");
                    assert_eq!(wc.opcode, WcOpcode::Recv);
                    assert_eq!(wc.byte_len as usize, MSG);
                    assert_eq!(wc.qp_num.get(), qpn);
                    let mut got = vec![0; MSG];
                    let slot = (next % RECVS) as usize;
                    assert!(block.read(RECV_AREA + slot * MSG, &mut got));
                    assert_eq!(got, pattern(next, MSG), "receive {next}");
                };
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(check)).is_err() {
                    p.failed.store(true, Ordering::Release);
                    panic!("receive {next} wrong");
                }
                next += 1;
                p.received.store(next, Ordering::Release);
                if next + RECVS - 1 < sends {
                    post_recv(next + RECVS - 1);
                }
            });
        }));
    }

    // Sender's poller: every WR back once, in order, with its opcode.
    {
        let (w2, hca, i, cq, progress) = (
            w.clone(),
            hca_from.clone(),
            from.i,
            from.send_cq,
            progress.clone(),
        );
        threads.push(thread::spawn(move || {
            let mut next = 0u64;
            let p = progress.clone();
            poll_thread(w2, hca, i, cq, count, progress, |wc| {
                let ok = wc.status == WcStatus::Success
                    && wc.wr_id == next
                    && wc.opcode
                        == if is_write(next) {
                            WcOpcode::RdmaWrite
                        } else {
                            WcOpcode::Send
                        };
                if !ok {
                    p.failed.store(true, Ordering::Release);
                    panic!("send-side completion {next}: {wc:?}");
                }
                next += 1;
                p.sent.store(next, Ordering::Release);
            });
        }));
    }

    // Sender: posts in batches, within the window and the receiver's
    // posted receives.
    {
        let (w2, hca, qp, progress) = (w.clone(), hca_from.clone(), from.qp, progress.clone());
        let block = from.block.clone();
        let (lkey, remote) = (
            from.keys.lkey,
            RemoteAddr {
                addr: to.block.va() + WRITE_AREA as u64,
                rkey: to.keys.rkey,
            },
        );
        // One scatter entry per send slot, for the whole run.
        let send_sges: Vec<&'static [Sge]> = (0..SLOTS)
            .map(|slot| {
                let sge = Sge::new(
                    block.va() + (SEND_AREA + slot * MSG) as u64,
                    MSG as u32,
                    lkey,
                );
                &*Box::leak(Box::new([sge])) as &'static [Sge]
            })
            .collect();
        threads.push(thread::spawn(move || {
            let mut seq = 0u64;
            while seq < count {
                wait_for("room to post", || {
                    progress.failed.load(Ordering::Acquire)
                        || (progress.sent.load(Ordering::Acquire) + WINDOW > seq
                            && (is_write(seq)
                                || progress.recvs_posted.load(Ordering::Acquire)
                                    > sends_before(seq)))
                });
                assert!(!progress.failed.load(Ordering::Acquire));
                // A batch of up to 4 WRs that fit the window.
                let mut wrs = Vec::new();
                let mut s = seq;
                while s < count
                    && wrs.len() < 4
                    && s < progress.sent.load(Ordering::Acquire) + WINDOW
                    && (is_write(s)
                        || progress.recvs_posted.load(Ordering::Acquire) > sends_before(s))
                {
                    let slot = (s as usize) % SLOTS;
                    let offset = SEND_AREA + slot * MSG;
                    let (tag, op, remote_offset) = if is_write(s) {
                        (s | 1 << 40, None, slot * MSG)
                    } else {
                        (sends_before(s), Some(()), 0)
                    };
                    assert!(block.write(offset, &pattern(tag, MSG)));
                    wrs.push(SendWr {
                        wr_id: s,
                        op: match op {
                            Some(()) => SendOp::Send,
                            None => SendOp::RdmaWrite {
                                remote: RemoteAddr {
                                    addr: remote.addr + remote_offset as u64,
                                    rkey: remote.rkey,
                                },
                            },
                        },
                        flags: SendFlags::SIGNALED,
                        sg_list: send_sges[slot],
                        ud: None,
                    });
                    s += 1;
                }
                let requests = support::plain_sends(&wrs);
                let (posted, status) = at_dispatch(&w2, || hca.post_send(qp, &requests));
                assert!(
                    status == IbStatus::Success || status == IbStatus::InsufficientResources,
                    "{status:?}"
                );
                seq += posted as u64;
            }
        }));
    }
    threads
}

/// A threaded host with two two-port HCAs and a side on each, their QPs
/// connected: `a` on the HCA of `GUIDS[0]`, `b` on the other.
fn connected_pair() -> (Arc<World>, Side, Side) {
    let configs = vec![
        DeviceConfig::with_ports(GUIDS[0], &HCA_IPS[0]),
        DeviceConfig::with_ports(GUIDS[1], &HCA_IPS[1]),
    ];
    let w = Arc::new(World::threaded_with_hcas(
        2,
        configs,
        hca_miniport_core::init::HcaConfig::default(),
    ));
    let guid = |i: usize| w.hca_at(i).report().unwrap().capabilities.node_guid.get();
    let x = if guid(0) == GUIDS[0] { 0 } else { 1 };
    let (a, b) = (side(&w, x), side(&w, 1 - x));
    connect(&w, &a, b.qpn, HCA_IPS[1][0]);
    connect(&w, &b, a.qpn, HCA_IPS[0][0]);
    (w, a, b)
}

/// Queues the DPC of every interrupt message of both HCAs again and again
/// until `stop`: each message has its own DPC (as each `WDFINTERRUPT`
/// has), so the workers run several `Hca::dpc` of one device at once.
/// Returns the thread and how many rounds it made.
fn dpc_storm(w: &World, stop: Arc<AtomicBool>) -> thread::JoinHandle<u64> {
    let dpcs: Vec<_> = (0..2)
        .flat_map(|i| w.device_at(i).interrupt_dpcs())
        .collect();
    assert!(dpcs.len() >= 4, "several messages per HCA");
    thread::spawn(move || {
        let mut rounds = 0;
        while !stop.load(Ordering::Acquire) {
            for dpc in &dpcs {
                dpc.insert_dpc();
            }
            rounds += 1;
            thread::sleep(Duration::from_micros(50));
        }
        rounds
    })
}

fn run(count: u64, with_dpc_storm: bool) {
    let (w, a, b) = connected_pair();

    let started = Instant::now();
    let stop_storm = Arc::new(AtomicBool::new(false));
    let storm = with_dpc_storm.then(|| dpc_storm(&w, stop_storm.clone()));
    let mut threads = direction(&w, &a, &b, count);
    threads.extend(direction(&w, &b, &a, count));
    let mut failures = Vec::new();
    for t in threads {
        if let Err(e) = t.join() {
            failures.push(e);
        }
    }
    stop_storm.store(true, Ordering::Release);
    if let Some(storm) = storm {
        let rounds = storm.join().expect("the storm thread");
        assert!(rounds > 0);
    }
    if let Some(e) = failures.into_iter().next() {
        std::panic::resume_unwind(e);
    }
    let elapsed = started.elapsed();
    eprintln!(
        "{} WRs each way ({} total) in {elapsed:?}",
        count,
        2 * count
    );

    // Each write area holds, per slot, the last RDMA write to it.
    for s in [&a, &b] {
        for slot in 0..SLOTS as u64 {
            let last = (0..count)
                .rev()
                .find(|q| q % SLOTS as u64 == slot && is_write(*q));
            if let Some(q) = last {
                let mut got = vec![0; MSG];
                assert!(s.block.read(WRITE_AREA + slot as usize * MSG, &mut got));
                assert_eq!(got, pattern(q | 1 << 40, MSG), "write slot {slot}");
            }
        }
    }
    // Nothing left over in any CQ.
    for s in [&a, &b] {
        let hca = w.hca_at(s.i);
        let mut wcs = [WorkCompletion::EMPTY; 4];
        for cq in [s.send_cq, s.recv_cq] {
            assert_eq!(at_dispatch(&w, || hca.poll_cq(cq, &mut wcs)), Ok(0));
        }
    }
    teardown(&w, a);
    teardown(&w, b);
    let w = Arc::try_unwrap(w).ok().expect("the threads are done");
    w.finish();
}

#[test]
fn post_and_poll_on_different_threads_on_both_hcas() {
    run(12_000, false);
}

/// The same traffic while every interrupt message's DPC is queued over
/// and over: DPCs of one device running at once on different workers
/// (the EQ drain hand-off lets one drain at a time and loses no wake-up)
/// lose, double or reorder no completion.
#[test]
fn post_and_poll_while_every_message_dpc_runs_at_once() {
    run(4_000, true);
}

#[test]
#[ignore = "soak: cargo test -p hca-miniport-core --test scenarios_threads -- --ignored"]
fn post_and_poll_on_different_threads_soak() {
    run(400_000, false);
}

/// The object-table acquisitions the calling thread makes while running
/// `f` at DISPATCH_LEVEL in the miniport's context, with `f`'s result.
fn counting<R>(w: &World, f: impl FnOnce() -> R) -> (R, RwAcquisitions) {
    let before = rw_spin_lock::acquisitions();
    let result = at_dispatch(w, f);
    (result, rw_spin_lock::acquisitions().since(before))
}

/// Post and poll share no lock but the object tables, and those only
/// shared: (1) every post_send, post_recv and poll_cq (with its
/// completions' `wr_id` resolution) takes the tables shared and never
/// exclusive; (2) while one thread holds both HCAs' object tables shared,
/// another thread posts sends and receives on them and polls their CQs to
/// completion (under an exclusive lock, or the spin lock before, it would
/// wait for the holder, which waits for it: the test fails at the
/// holder's deadline, as checked by making the holder exclusive).
#[test]
fn post_and_poll_take_the_object_tables_shared_and_a_shared_holder_delays_neither() {
    let (w, a, b) = connected_pair();
    let (hca_a, hca_b) = (w.hca_at(a.i), w.hca_at(b.i));

    // One send of `a` to `b`, tagged `tag`: posts a receive on `b`, the
    // send on `a`, polls both CQs until each gave its completion, checks
    // the bytes. Returns the acquisitions of this thread.
    let round = |tag: u64| -> RwAcquisitions {
        let mut total = RwAcquisitions::default();
        let mut add = |c: RwAcquisitions| {
            total.shared += c.shared;
            total.shared_waited += c.shared_waited;
            total.exclusive += c.exclusive;
            total.exclusive_waited += c.exclusive_waited;
        };
        let recv_sge = [Sge::new(
            b.block.va() + RECV_AREA as u64,
            MSG as u32,
            b.keys.lkey,
        )];
        let recv = RecvWr {
            wr_id: 1000 + tag,
            sg_list: &recv_sge,
        };
        let (posted, c) = counting(&w, || hca_b.post_recv(b.qp, &[recv]));
        assert_eq!(posted, (1, IbStatus::Success));
        add(c);
        assert!(a.block.write(SEND_AREA, &pattern(tag, MSG)));
        let send_sge = [Sge::new(
            a.block.va() + SEND_AREA as u64,
            MSG as u32,
            a.keys.lkey,
        )];
        let send = SendRequest {
            wr: SendWr {
                wr_id: 2000 + tag,
                op: SendOp::Send,
                flags: SendFlags::SIGNALED,
                sg_list: &send_sge,
                ud: None,
            },
            av: None,
            inline: None,
        };
        let (posted, c) = counting(&w, || hca_a.post_send(a.qp, &[send]));
        assert_eq!(posted, (1, IbStatus::Success));
        add(c);
        for (hca, cq, wr_id, opcode) in [
            (&hca_a, a.send_cq, 2000 + tag, WcOpcode::Send),
            (&hca_b, b.recv_cq, 1000 + tag, WcOpcode::Recv),
        ] {
            let mut wcs = [WorkCompletion::EMPTY; 2];
            let mut got = 0;
            wait_for("the completion", || {
                let (polled, c) = counting(&w, || hca.poll_cq(cq, &mut wcs));
                add(c);
                got = polled.unwrap();
                got > 0
            });
            assert_eq!(got, 1);
            assert_eq!(wcs[0].status, WcStatus::Success, "{:?}", wcs[0]);
            assert_eq!((wcs[0].wr_id, wcs[0].opcode), (wr_id, opcode));
        }
        let mut received = vec![0; MSG];
        assert!(b.block.read(RECV_AREA, &mut received));
        assert_eq!(received, pattern(tag, MSG));
        total
    };

    // (1) Post and poll on this thread: shared only, never exclusive.
    for tag in 0..8 {
        let c = round(tag);
        assert_eq!(
            (c.exclusive, c.exclusive_waited),
            (0, 0),
            "round {tag}: {c:?}"
        );
        assert!(
            c.shared >= 4,
            "round {tag}: every verb looked its object up: {c:?}"
        );
    }

    // (2) A holder of both HCAs' tables (shared) on another thread waits
    // for rounds run here; it lets go only after them.
    let (held_tx, held_rx) = std::sync::mpsc::channel::<()>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let holder = {
        let (w, hca_a, hca_b) = (w.clone(), hca_a.clone(), hca_b.clone());
        thread::spawn(move || {
            let _context =
                context::enter(Context::driver(w.host.verifier().clone(), support::DRIVER));
            let held = hca_a.hold_object_tables_shared(|| {
                hca_b.hold_object_tables_shared(|| {
                    assert_eq!(sim_host::irql::current(), Irql::DISPATCH);
                    held_tx.send(()).unwrap();
                    // Not a timing assertion: the deadline only turns a
                    // deadlock into a failure.
                    done_rx.recv_timeout(Duration::from_secs(60)).is_ok()
                })
            });
            assert_eq!(
                held,
                Ok(Ok(true)),
                "the rounds finished while the tables were held"
            );
        })
    };
    held_rx.recv().unwrap();
    for tag in 100..104 {
        let c = round(tag);
        assert_eq!(c.exclusive, 0, "{c:?}");
    }
    done_tx.send(()).unwrap();
    holder.join().unwrap();

    teardown(&w, a);
    teardown(&w, b);
    let w = Arc::try_unwrap(w).ok().expect("the threads are done");
    w.finish();
}

/// Issue 9, defect 3: two processors polling one CQ. HCA A posts RDMA
/// writes to B (every fourth unsignaled, retired by the next signaled
/// one's completion) as fast as its send queue takes them, while two
/// threads poll A's send CQ at once in small batches. Every signaled
/// `wr_id` comes back exactly once, each poller sees its share in posting
/// order, and the send queue never wedges (a completion tail thrown by
/// an out-of-order retire made post answer InsufficientResources for
/// ever).
#[test]
fn two_threads_polling_one_cq_get_every_wr_id_once_and_the_queue_never_wedges() {
    const WRITES: u64 = 40_000;
    let signaled = |seq: u64| seq % 4 != 1 || seq + 1 == WRITES;
    let (w, a, b) = connected_pair();

    let hca = w.hca_at(a.i);
    let expected = (0..WRITES).filter(|&s| signaled(s)).count() as u64;
    let completed = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicBool::new(false));
    let pollers: Vec<_> = (0..2)
        .map(|_| {
            let (w, hca, cq) = (w.clone(), hca.clone(), a.send_cq);
            let (completed, failed) = (completed.clone(), failed.clone());
            thread::spawn(move || {
                let mut mine = Vec::new();
                let mut wcs = [WorkCompletion::EMPTY; 2];
                while completed.load(Ordering::Acquire) < expected
                    && !failed.load(Ordering::Acquire)
                {
                    let n = at_dispatch(&w, || hca.poll_cq(cq, &mut wcs)).unwrap();
                    for wc in &wcs[..n] {
                        if wc.status != WcStatus::Success || wc.opcode != WcOpcode::RdmaWrite {
                            failed.store(true, Ordering::Release);
                            panic!("completion {wc:?}");
                        }
                        mine.push(wc.wr_id);
                    }
                    completed.fetch_add(n as u64, Ordering::AcqRel);
                    if n == 0 {
                        thread::yield_now();
                    }
                }
                mine
            })
        })
        .collect();

    let sge: &'static [Sge] = Box::leak(Box::new([Sge::new(
        a.block.va() + SEND_AREA as u64,
        MSG as u32,
        a.keys.lkey,
    )]));
    let remote = RemoteAddr {
        addr: b.block.va() + WRITE_AREA as u64,
        rkey: b.keys.rkey,
    };
    let mut seq = 0u64;
    let mut stalled_since = Instant::now();
    while seq < WRITES {
        assert!(!failed.load(Ordering::Acquire), "a poller failed");
        let wrs: Vec<SendRequest<'_>> = (seq..WRITES.min(seq + 4))
            .map(|s| SendRequest {
                wr: SendWr {
                    wr_id: s,
                    op: SendOp::RdmaWrite { remote },
                    flags: if signaled(s) {
                        SendFlags::SIGNALED
                    } else {
                        SendFlags::empty()
                    },
                    sg_list: sge,
                    ud: None,
                },
                av: None,
                inline: None,
            })
            .collect();
        let (posted, status) = at_dispatch(&w, || hca.post_send(a.qp, &wrs));
        assert!(
            status == IbStatus::Success || status == IbStatus::InsufficientResources,
            "{status:?}"
        );
        if posted > 0 {
            stalled_since = Instant::now();
        } else {
            let stalled = stalled_since.elapsed();
            if stalled > Duration::from_secs(10) {
                failed.store(true, Ordering::Release);
                panic!("the send queue wedged at WR {seq} (full for {stalled:?})");
            }
            thread::yield_now();
        }
        seq += posted as u64;
    }
    let mut all = Vec::new();
    for poller in pollers {
        let mine = poller.join().expect("a poller failed");
        assert!(
            mine.windows(2).all(|p| p[0] < p[1]),
            "each poller's completions in posting order"
        );
        all.extend(mine);
    }
    all.sort_unstable();
    let want: Vec<u64> = (0..WRITES).filter(|&s| signaled(s)).collect();
    assert_eq!(all.len(), want.len(), "every signaled WR completes once");
    assert_eq!(all, want, "each with its own wr_id");
    teardown(&w, a);
    teardown(&w, b);
    let w = Arc::try_unwrap(w).ok().expect("the threads are done");
    w.finish();
}
