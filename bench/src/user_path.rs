//! Measurements 1, 2 and 3: a user process's RC QPs through the access
//! library (`ibal-user`) and the plugin's fast path (`uvp-plugin`: WQEs
//! written into the process's rings, doorbells through its mapped UAR
//! page, CQEs polled by owner bit), over the real miniport and bus filter
//! on the threaded host, where a doorbell runs the device (and the fabric,
//! and the peer device) in the ringing thread. Control verbs go through the
//! proxy IOCTLs; the timed loops make no kernel call.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use ib_types::access::AccessFlags;
use ib_types::qp::{QpCaps, QpType};
use ib_types::scalars::{Gid, Mtu, PortNum, Qpn};
use ib_types::wc::{WcStatus, WorkCompletion};
use ib_types::wr::{LKey, RKey, RecvWr, RemoteAddr, SendFlags, SendOp, SendWr, Sge};
use ibal_user::{Buffer, CaSelector, Context, Cq, Mr, Pd, PluginSource, Qp, QpInit, UserSend};
use sim_host::memory::Process;
use sim_shells::rc_path::rc_to_rts_steps;

use crate::spin::{self, Backoff};
use crate::world::{World, port_ip};

/// Receive completions carry this bit in their `wr_id`.
const RECV_TAG: u64 = 1 << 63;

/// One side of a connection: its QPs (all on one CQ), its buffer and keys.
pub struct Endpoint<'a> {
    /// The RC QPs, connected one to one with the other side's.
    pub qps: Vec<Qp<'a, 'a>>,
    /// The CQ of every QP's both queues.
    pub cq: &'a Cq<'a>,
    /// The registered buffer.
    pub buffer: &'a Buffer<'a>,
    /// Its local key.
    pub lkey: LKey,
    /// Its remote key (remote write granted).
    pub rkey: RKey,
}

impl std::fmt::Debug for Endpoint<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("qps", &self.qps.len())
            .finish_non_exhaustive()
    }
}

/// The shape of a connection.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// QPs per side.
    pub qps: usize,
    /// Send and receive queue depth of each.
    pub depth: u32,
    /// CQ entries per side.
    pub cqe: u32,
    /// Buffer bytes per side.
    pub buffer: usize,
}

/// Opens HCA 0 and HCA 1 in one user process, connects `shape.qps` RC QP
/// pairs between their port 1s (4096-byte MTU, remote write), runs `body`
/// with the two endpoints, then destroys everything through the proxy and
/// ends the process, which must leave no page locked.
pub fn with_connection<R>(
    world: &World,
    pid: u32,
    shape: Shape,
    body: impl FnOnce(&mut Endpoint<'_>, &mut Endpoint<'_>) -> R,
) -> R {
    let process = Process::new(pid);
    let io = world.io(&process);
    let result = {
        let open = |at| Context::open(&io, CaSelector::Index(at), &PluginSource::Linked);
        let (ctx_a, ctx_b) = (open(0).expect("open HCA 0"), open(1).expect("open HCA 1"));
        let (pd_a, pd_b) = (Pd::new(&ctx_a).unwrap(), Pd::new(&ctx_b).unwrap());
        let buf_a = Buffer::new(&ctx_a, shape.buffer).unwrap();
        let buf_b = Buffer::new(&ctx_b, shape.buffer).unwrap();
        let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
        let mr_a = Mr::new(&pd_a, &buf_a, access).unwrap();
        let mr_b = Mr::new(&pd_b, &buf_b, access).unwrap();
        let cq_a = Cq::new(&ctx_a, shape.cqe).unwrap();
        let cq_b = Cq::new(&ctx_b, shape.cqe).unwrap();
        let init = QpInit {
            qp_type: QpType::Rc,
            caps: QpCaps {
                max_send_wr: shape.depth,
                max_recv_wr: shape.depth,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 64,
            },
            sq_sig_all: false,
        };
        let make = |pd, cq| -> Vec<Qp<'_, '_>> {
            (0..shape.qps)
                .map(|_| Qp::new(pd, cq, cq, &init).expect("create QP"))
                .collect()
        };
        let qps_a = make(&pd_a, &cq_a);
        let qps_b = make(&pd_b, &cq_b);
        for (a, b) in qps_a.iter().zip(&qps_b) {
            connect(a, b.qpn(), port_ip(1, 1));
            connect(b, a.qpn(), port_ip(0, 1));
        }
        let mut a = Endpoint {
            qps: qps_a,
            cq: &cq_a,
            buffer: &buf_a,
            lkey: mr_a.keys().lkey,
            rkey: mr_a.keys().rkey,
        };
        let mut b = Endpoint {
            qps: qps_b,
            cq: &cq_b,
            buffer: &buf_b,
            lkey: mr_b.keys().lkey,
            rkey: mr_b.keys().rkey,
        };
        body(&mut a, &mut b)
    };
    assert_eq!(process.exit(), 0, "the process left pages locked");
    result
}

/// Takes `qp` to RTS towards QP `dest` at port 1 of the HCA at `dest_ip`,
/// with the largest path MTU (a bandwidth run's choice).
fn connect(qp: &Qp<'_, '_>, dest: u32, dest_ip: [u8; 4]) {
    let mut steps = rc_to_rts_steps(
        PortNum::new(1).unwrap(),
        AccessFlags::REMOTE_WRITE,
        Qpn::new(dest).unwrap(),
        Gid::from_ipv4(dest_ip),
        1,
    );
    steps[1].path_mtu = Some(Mtu::Mtu4096);
    for (i, step) in steps.iter().enumerate() {
        if let Err(e) = qp.modify(step) {
            panic!("RC bring-up, step {i} {step:?}: {e:?}");
        }
    }
}

/// Posts one receive of `len` bytes at `offset` of the endpoint's buffer.
fn post_recv(qp: &mut Qp<'_, '_>, buffer: &Buffer<'_>, lkey: LKey, offset: u64, len: u32) {
    let sge = [Sge::new(buffer.va() + offset, len, lkey)];
    let wr = [RecvWr {
        wr_id: RECV_TAG | offset,
        sg_list: &sge,
    }];
    assert_eq!(qp.post_recv(&wr).expect("post_recv"), 1);
}

/// Polls `cq` until a receive completes: the buffer offset it landed at
/// (its `wr_id`'s). Send completions on the way are consumed. Panics on
/// an error completion.
fn wait_recv(cq: &Cq<'_>, wcs: &mut [WorkCompletion; 4]) -> u64 {
    let mut backoff = Backoff::new();
    loop {
        let n = cq.poll(wcs).expect("poll");
        let mut got = None;
        for wc in &wcs[..n] {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
            if wc.wr_id & RECV_TAG != 0 {
                got = Some(wc.wr_id & !RECV_TAG);
            }
        }
        if let Some(offset) = got {
            return offset;
        }
        backoff.snooze();
    }
}

/// Receives kept posted on each side of the ping-pong.
const PINGPONG_RECVS: u64 = 16;
/// Every this many sends one is signaled, so the send queue's slots come
/// back.
const SIGNAL_EVERY: u64 = 16;

/// Posts the receives each side of [`send_ping_pong`] keeps posted (once
/// per connection: each round consumes one and posts it again).
pub fn prepare_ping_pong(a: &mut Endpoint<'_>, b: &mut Endpoint<'_>) {
    for i in 0..PINGPONG_RECVS {
        post_recv(&mut a.qps[0], a.buffer, a.lkey, 64 * i, 64);
        post_recv(&mut b.qps[0], b.buffer, b.lkey, 64 * i, 64);
    }
}

/// Measurement 1: two threads (one per side) bounce an 8-byte inline RC
/// send `rounds` times: nanoseconds per half round trip. The payload is
/// checked on the last round. [`prepare_ping_pong`] first.
pub fn send_ping_pong(a: &mut Endpoint<'_>, b: &mut Endpoint<'_>, rounds: u64) -> f64 {
    let go = AtomicBool::new(false);
    let mut elapsed = 0.0;
    let mut last = 0;
    // Sends `round` (inline, 8 bytes); one in SIGNAL_EVERY signaled.
    fn send(side: &mut Endpoint<'_>, round: u64) {
        let payload = round.to_le_bytes();
        let sge = [Sge::new(0, 8, LKey::new(0))];
        let flags = if round % SIGNAL_EVERY == SIGNAL_EVERY - 1 {
            SendFlags::INLINE | SendFlags::SIGNALED
        } else {
            SendFlags::INLINE
        };
        let wr = [UserSend {
            wr: SendWr {
                wr_id: round,
                op: SendOp::Send,
                flags,
                sg_list: &sge,
                ud: None,
            },
            inline: Some(&payload),
        }];
        assert_eq!(side.qps[0].post_send(&wr).expect("post_send"), 1);
    }
    fn repost(side: &mut Endpoint<'_>, offset: u64) {
        post_recv(&mut side.qps[0], side.buffer, side.lkey, offset, 64);
    }
    std::thread::scope(|s| {
        let b = &mut *b;
        let go = &go;
        s.spawn(move || {
            let mut wcs = [WorkCompletion::EMPTY; 4];
            spin::until(|| go.load(Ordering::Acquire));
            for round in 0..rounds {
                let offset = wait_recv(b.cq, &mut wcs);
                repost(b, offset);
                send(b, round);
            }
        });
        let mut wcs = [WorkCompletion::EMPTY; 4];
        go.store(true, Ordering::Release);
        let started = Instant::now();
        for round in 0..rounds {
            send(a, round);
            last = wait_recv(a.cq, &mut wcs);
            repost(a, last);
        }
        elapsed = started.elapsed().as_secs_f64();
    });
    // The last round's reply, where its receive landed.
    let mut got = [0; 8];
    a.buffer.read(last as usize, &mut got).unwrap();
    assert_eq!(
        u64::from_le_bytes(got),
        rounds - 1,
        "the last reply's payload"
    );
    // Drain what is left (the other side's last signaled sends).
    let mut wcs = [WorkCompletion::EMPTY; 4];
    for cq in [a.cq, b.cq] {
        while cq.poll(&mut wcs).unwrap() > 0 {}
    }
    elapsed * 1e9 / (2 * rounds) as f64
}

/// Message size of measurement 2.
pub const RATE_MSG: usize = 64;

/// Measurement 2: one thread posts `messages` 64-byte inline RDMA writes
/// from A to B round-robin over A's QPs, `batch` per doorbell (the last
/// signaled), at most `window` batches in flight per QP; a second thread
/// polls A's CQ. Messages per second; B's buffer is checked to hold the
/// last message of each QP.
pub fn write_rate(a: &mut Endpoint<'_>, b: &Endpoint<'_>, messages: u64, batch: usize) -> f64 {
    let qps = a.qps.len();
    let depth = a.qps[0].caps().max_send_wr as usize;
    let window = (depth / batch).clamp(1, 4) as u64;
    let completed: Vec<AtomicU64> = (0..qps).map(|_| AtomicU64::new(0)).collect();
    let total_batches = messages.div_ceil(batch as u64);
    let done = AtomicU64::new(0);
    let (remote, rkey) = (b.buffer.va(), b.rkey);
    let cq = a.cq;
    let started = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut wcs = [WorkCompletion::EMPTY; 16];
            let mut backoff = Backoff::new();
            while done.load(Ordering::Relaxed) < total_batches {
                let n = cq.poll(&mut wcs).expect("poll");
                for wc in &wcs[..n] {
                    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
                    completed[wc.wr_id as usize].fetch_add(1, Ordering::Release);
                }
                done.fetch_add(n as u64, Ordering::Relaxed);
                if n == 0 {
                    backoff.snooze();
                }
            }
        });
        let mut posted = vec![0u64; qps];
        let mut payloads = vec![[0u8; RATE_MSG]; batch];
        let sge = [Sge::new(0, RATE_MSG as u32, LKey::new(0))];
        let mut sent = 0u64;
        let mut next = 0usize;
        for _ in 0..total_batches {
            let q = next;
            next = (next + 1) % qps;
            spin::until(|| posted[q] - completed[q].load(Ordering::Acquire) < window);
            let n = batch.min((messages - sent) as usize);
            for (i, p) in payloads[..n].iter_mut().enumerate() {
                p[..8].copy_from_slice(&(sent + i as u64).to_le_bytes());
            }
            let wrs: Vec<UserSend<'_>> = payloads[..n]
                .iter()
                .enumerate()
                .map(|(i, p)| UserSend {
                    wr: SendWr {
                        wr_id: q as u64,
                        op: SendOp::RdmaWrite {
                            remote: RemoteAddr {
                                addr: remote + (q * RATE_MSG) as u64,
                                rkey,
                            },
                        },
                        flags: if i + 1 == n {
                            SendFlags::INLINE | SendFlags::SIGNALED
                        } else {
                            SendFlags::INLINE
                        },
                        sg_list: &sge,
                        ud: None,
                    },
                    inline: Some(p),
                })
                .collect();
            assert_eq!(a.qps[q].post_send(&wrs).expect("post_send"), n);
            posted[q] += 1;
            sent += n as u64;
        }
    });
    let rate = messages as f64 / started.elapsed().as_secs_f64();
    // The last batch's last message is at its QP's slot of B.
    let last_q = ((total_batches - 1) % qps as u64) as usize;
    let mut got = [0; 8];
    b.buffer.read(last_q * RATE_MSG, &mut got).unwrap();
    assert_eq!(u64::from_le_bytes(got), messages - 1, "the last write");
    rate
}

/// Measurement 3: one thread RDMA-writes A's whole buffer into B's `times`
/// times, one signaled write at a time, polling its completion: bytes per
/// second. B's buffer is checked to equal A's.
pub fn write_bandwidth(a: &mut Endpoint<'_>, b: &Endpoint<'_>, times: usize) -> f64 {
    let len = a.buffer.len();
    let pattern: Vec<u8> = (0..len).map(|i| (i as u8) ^ (i >> 12) as u8).collect();
    a.buffer.write(0, &pattern).unwrap();
    let sge = [Sge::new(a.buffer.va(), len as u32, a.lkey)];
    let mut wcs = [WorkCompletion::EMPTY; 4];
    let started = Instant::now();
    for i in 0..times {
        let wr = [UserSend {
            wr: SendWr {
                wr_id: i as u64,
                op: SendOp::RdmaWrite {
                    remote: RemoteAddr {
                        addr: b.buffer.va(),
                        rkey: b.rkey,
                    },
                },
                flags: SendFlags::SIGNALED,
                sg_list: &sge,
                ud: None,
            },
            inline: None,
        }];
        assert_eq!(a.qps[0].post_send(&wr).expect("post_send"), 1);
        let mut backoff = Backoff::new();
        loop {
            let n = a.cq.poll(&mut wcs).expect("poll");
            if n > 0 {
                assert_eq!(wcs[0].status, WcStatus::Success, "{:?}", wcs[0]);
                break;
            }
            backoff.snooze();
        }
    }
    let rate = (len * times) as f64 / started.elapsed().as_secs_f64();
    let mut got = vec![0; len];
    b.buffer.read(0, &mut got).unwrap();
    assert!(got == pattern, "B holds A's bytes");
    rate
}
