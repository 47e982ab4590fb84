//! The UVP plugin's kernel-bypass fast path (`uvp_plugin`), on the
//! simulated host with the real miniport: a user process opens its context
//! and creates its CQ, QP and SRQ through the device stack (proxy IOCTLs
//! carrying the PRM 13 private data), then moves data with a kernel QP on
//! another HCA using only the plugin — WQEs written through raw pointers
//! into the process's real memory, doorbells through the plugin's MMIO
//! primitive (the simulator's hook), CQEs polled by the owner bit — with
//! every byte checked, rings wrapped many times, failures that leave the
//! rings consistent, another process's doorbell page ignored by the device,
//! and the process's request count unchanged over the whole data phase.
//! Each test ends with the host shut down and the verifier clean.

mod support;

use std::sync::Arc;

use driver_platform::{Mmio, RequestorMode};
use hca_prm::doorbell::{CQ_DOORBELL, CqArm, CqDoorbell, SQ_DOORBELL, SqDoorbell};
use hca_prm::uverbs::{
    CreateCqPriv, CreateCqPrivOut, CreateQpPriv, CreateQpPrivOut, CreateSrqPriv, CreateSrqPrivOut,
    OpenCaPriv,
};
use ib_types::access::AccessFlags;
use ib_types::cq::CqAttr;
use ib_types::handle::{CqHandle, PdHandle, SrqHandle};
use ib_types::ioctl::{
    AllocPd, CloseCa, CreateCq, CreateQp, CreateSrq, DeregMr, DestroyCq, DestroyQp, DestroySrq,
    Empty, ModifyQp, OpenCa, OpenCaIn, RegMr, Verb, WaitCqEvent, encode_request, request_len,
    response_len,
};
use ib_types::qp::{QpCaps, QpCreate, QpType};
use ib_types::srq::{SrqAttr, SrqCreate};
use ib_types::status::IbStatus;
use ib_types::wc::{WcOpcode, WcStatus, WorkCompletion};
use ib_types::wr::{LKey, RecvWr, SendFlags, SendOp, SendWr, Sge, WrError};
use sim_host::memory::Process;
use sim_host::request::Completion;
use support::kernel_pair::{self, KernelBuf, Setup};
use support::rc_path::rc_to_rts_steps;
use support::{World, response};
use uvp_plugin::{ArmFor, Context, Cq, PostErrorKind, Qp, QpCreated, SendRequest, Srq, UarPage};
use zerocopy::IntoBytes;

const KERNEL: RequestorMode = RequestorMode::Kernel;
const GUIDS: [u64; 2] = [0x0002_C900_0000_5000, 0x0002_C900_0000_6000];
const IPS: [[[u8; 4]; 2]; 2] = [
    [[10, 0, 0, 1], [10, 0, 1, 1]],
    [[10, 0, 2, 1], [10, 0, 3, 1]],
];
/// The user's and the kernel's port-1 addresses.
const USER_IP: [u8; 4] = IPS[0][0];
const KERNEL_IP: [u8; 4] = IPS[1][0];

/// Deterministic, non-trivial bytes.
fn pattern(seed: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u32)
                .wrapping_mul(31)
                .wrapping_add(seed.wrapping_mul(7)) as u8
        })
        .collect()
}

/// Sends `V` down HCA `i`'s device stack as a user request of `process`
/// (the proxy IOCTL path), runs the machine, and returns the completion.
fn user_call<V: Verb>(
    w: &World,
    i: usize,
    process: &Process,
    handle: u64,
    input: &V::In,
    private: &[u8],
) -> Completion {
    let mut bytes = vec![0; request_len::<V>(private.len()).unwrap()];
    encode_request::<V>(handle, input, private, 64, &mut bytes).unwrap();
    let (mut request, issuer) = w.raw_request(
        V::ID.ioctl().raw(),
        RequestorMode::User,
        bytes,
        response_len::<V>(64).unwrap(),
    );
    request.set_process(process.clone());
    w.host.pnp().send_request(w.device_at(i).node(), request);
    run_until_done(w, &issuer)
}

/// Runs the machine until `issuer`'s request completed: the deterministic
/// host settles; a threaded host's workers run it while this thread waits.
fn run_until_done(w: &World, issuer: &sim_host::request::RequestHandle) -> Completion {
    if w.host.scheduler_handle().mode() == sim_host::sched::Mode::Deterministic {
        w.settle();
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        if let Some(done) = issuer.completion() {
            return done;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the request timed out"
        );
        std::thread::sleep(std::time::Duration::from_micros(100));
    }
}

/// One user process with an open context on HCA `i` and the plugin's
/// fast-path state for it.
struct User {
    process: Process,
    i: usize,
    ca: u64,
    doorbell: u64,
    ctx: Context,
    /// The next doorbell record: records are packed 4 bytes apart in one
    /// page, so two of them share each 64-bit word (the provider's record
    /// store must keep the other half).
    next_record: std::cell::Cell<u64>,
}

/// A user QP: its handle and the plugin's half.
struct UserQp {
    handle: u64,
    qp: Qp,
}

impl User {
    fn open(w: &World, i: usize, pid: u32) -> Self {
        let process = Process::new(pid);
        let c = user_call::<OpenCa>(w, i, &process, 0, &OpenCaIn::CURRENT, &[]);
        let r = response::<OpenCa>(&c);
        assert_eq!(r.status, IbStatus::Success);
        let limits = OpenCaPriv::parse(r.private).unwrap();
        let doorbell = r.output.unwrap().doorbell.unwrap().va;
        // The simulator's side of the plugin's MMIO primitive: a store to
        // the mapped UAR page reaches the device in the calling thread.
        let mapped = process.clone();
        let hook = Arc::new(move |address: u64, value: u64| {
            // A store outside the mapping goes nowhere (it would fault).
            let _ = mapped.write_device64(address, value);
        });
        let records = process.alloc(4096).unwrap();
        Self {
            ctx: Context::new(limits, UarPage::simulated(doorbell, hook)),
            process,
            i,
            ca: r.handle,
            doorbell,
            next_record: std::cell::Cell::new(records),
        }
    }

    /// The next 4-byte doorbell record.
    fn record(&self) -> u64 {
        let va = self.next_record.get();
        self.next_record.set(va + 4);
        va
    }

    fn call<V: Verb>(&self, w: &World, handle: u64, input: &V::In, private: &[u8]) -> Completion {
        user_call::<V>(w, self.i, &self.process, handle, input, private)
    }

    #[track_caller]
    fn expect<V: Verb>(&self, w: &World, handle: u64, input: &V::In) {
        let c = self.call::<V>(w, handle, input, &[]);
        assert_eq!(response::<V>(&c).status, IbStatus::Success);
    }

    fn alloc_pd(&self, w: &World) -> u64 {
        let c = self.call::<AllocPd>(w, self.ca, &Empty, &[]);
        response::<AllocPd>(&c).handle
    }

    /// A CQ of `2^log` CQEs: ring and record allocated in the process.
    fn create_cq(&self, w: &World, log: u8) -> (u64, Cq) {
        let ring = self.process.alloc(32 << log).unwrap();
        let layout = CreateCqPriv::new(log, ring, self.record()).unwrap();
        let attr = CqAttr {
            cqe: 1 << log,
            comp_vector: 0,
        };
        let c = self.call::<CreateCq>(w, self.ca, &attr, layout.emit().as_bytes());
        let r = response::<CreateCq>(&c);
        assert_eq!(r.status, IbStatus::Success);
        let created = CreateCqPrivOut::parse(r.private).unwrap();
        // SAFETY: the ring and record are allocations of this process,
        // which outlives the CQ (it exits after the test drops it); the
        // process's frames are atomic words and the device reaches them by
        // DMA only.
        let cq = unsafe { self.ctx.cq(&layout, &created) }.unwrap();
        (r.handle, cq)
    }

    /// An SRQ of 8 WQEs with one SGE each.
    fn create_srq(&self, w: &World, pd: u64) -> (u64, Srq) {
        let ring = self.process.alloc(256).unwrap();
        let layout = CreateSrqPriv::new(3, 5, ring, self.record()).unwrap();
        let create = SrqCreate {
            pd: PdHandle::from_raw(pd),
            attr: SrqAttr {
                max_wr: 8,
                max_sge: 1,
                srq_limit: 0,
            },
        };
        let c = self.call::<CreateSrq>(w, self.ca, &create, layout.emit().as_bytes());
        let r = response::<CreateSrq>(&c);
        assert_eq!(r.status, IbStatus::Success);
        let created = CreateSrqPrivOut::parse(r.private).unwrap();
        let max_sge = r.output.unwrap().max_sge;
        // SAFETY: as for `create_cq`.
        let srq = unsafe { self.ctx.srq(&layout, &created, max_sge) }.unwrap();
        (r.handle, srq)
    }

    /// A QP of `qp_type` on CQ `cq`: 16 send basic blocks in 128-byte
    /// WQEs (8 sends of up to 7 SGEs or ~100 inline bytes), and either 16
    /// receives of 64 bytes (3 SGEs) or `srq`.
    fn create_qp(
        &self,
        w: &World,
        qp_type: QpType,
        pd: u64,
        cq: u64,
        srq: Option<(u64, &Srq)>,
    ) -> UserQp {
        let sq = self.process.alloc(64 << 4).unwrap();
        let rq = match srq {
            Some(_) => None,
            None => Some((4, 6, self.process.alloc(64 << 4).unwrap(), self.record())),
        };
        let layout = CreateQpPriv::new(4, 1, sq, rq).unwrap();
        let input = QpCreate {
            qp_type,
            pd: PdHandle::from_raw(pd),
            send_cq: CqHandle::from_raw(cq),
            recv_cq: CqHandle::from_raw(cq),
            srq: srq.map(|(handle, _)| SrqHandle::from_raw(handle)),
            caps: QpCaps {
                max_send_wr: 8,
                max_recv_wr: if srq.is_some() { 0 } else { 16 },
                max_send_sge: 1,
                max_recv_sge: if srq.is_some() { 0 } else { 1 },
                max_inline_data: if qp_type == QpType::Ud { 32 } else { 64 },
            },
            sq_sig_all: false,
            port: None,
        };
        let c = self.call::<CreateQp>(w, self.ca, &input, layout.emit().as_bytes());
        let r = response::<CreateQp>(&c);
        assert_eq!(r.status, IbStatus::Success, "{qp_type:?}");
        let created = QpCreated {
            qp_type,
            caps: r.output.unwrap().caps,
            private: CreateQpPrivOut::parse(r.private).unwrap(),
        };
        // SAFETY: as for `create_cq`.
        let qp = unsafe { self.ctx.qp(&layout, &created, srq.map(|(_, s)| s)) }.unwrap();
        UserQp {
            handle: r.handle,
            qp,
        }
    }

    /// `len` bytes of process memory registered for local and remote
    /// writes: (address, handle, L_Key).
    fn register(&self, w: &World, pd: u64, len: usize) -> (u64, u64, LKey) {
        let va = self.process.alloc(len).unwrap();
        let input = ib_types::mr::MrRegister {
            vaddr: va,
            length: len as u64,
            access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        };
        let c = self.call::<RegMr>(w, pd, &input, &[]);
        let r = response::<RegMr>(&c);
        assert_eq!(r.status, IbStatus::Success);
        (va, r.handle, r.output.unwrap().lkey)
    }

    fn read(&self, va: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0; len];
        self.process.read(va, &mut out).unwrap();
        out
    }
}

/// The kernel client on the other HCA: CA, PD, CQ, an RC QP and a
/// registered 64 KiB buffer.
struct Kernel {
    s: Setup,
    qp: u64,
    qpn: u32,
    buf: KernelBuf,
}

impl Kernel {
    fn new(w: &World, i: usize) -> Self {
        let s = kernel_pair::setup(w, i);
        let input = QpCreate {
            caps: QpCaps {
                max_send_wr: 16,
                max_recv_wr: 16,
                ..support::small_qp_create(QpType::Rc, s.pd, s.cq).caps
            },
            ..support::small_qp_create(QpType::Rc, s.pd, s.cq)
        };
        let c = w.call_in_dpc_at::<CreateQp>(i, KERNEL, s.ca, &input, 0);
        let r = response::<CreateQp>(&c);
        assert_eq!(r.status, IbStatus::Success);
        let buf = KernelBuf::register(
            w,
            &s,
            *b"UvpK",
            1 << 16,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        );
        Self {
            qp: r.handle,
            qpn: r.output.unwrap().qpn.get(),
            s,
            buf,
        }
    }

    fn post_recvs(&self, w: &World, recvs: Vec<(u64, Sge)>) {
        let out = Arc::new(std::sync::Mutex::new(None));
        let (hca, sink, qp) = (w.hca_at(self.s.i), out.clone(), self.qp);
        w.in_dpc(move || {
            let lists: Vec<[Sge; 1]> = recvs.iter().map(|(_, sge)| [*sge]).collect();
            let wrs: Vec<RecvWr<'_>> = recvs
                .iter()
                .zip(&lists)
                .map(|((wr_id, _), list)| RecvWr {
                    wr_id: *wr_id,
                    sg_list: list,
                })
                .collect();
            *support::lock(&sink) = Some(hca.post_recv(qp, &wrs));
        });
        w.settle();
        let posted = support::lock(&out).take().unwrap();
        assert_eq!(posted.1, IbStatus::Success);
    }

    /// Posts signaled sends of `(wr_id, sge, extra flags)`.
    fn post_sends(&self, w: &World, sends: Vec<(u64, Sge, SendFlags)>) {
        let wrs: Vec<SendWr<'static>> = sends
            .into_iter()
            .map(|(wr_id, sge, flags)| SendWr {
                wr_id,
                op: SendOp::Send,
                flags: SendFlags::SIGNALED | flags,
                sg_list: Vec::leak(vec![sge]),
                ud: None,
            })
            .collect();
        let n = wrs.len();
        assert_eq!(
            w.post_send_in_dpc(self.s.i, self.qp, wrs),
            (n, IbStatus::Success)
        );
    }

    fn poll(&self, w: &World) -> Vec<WorkCompletion> {
        kernel_pair::poll_all(w, self.s.i, self.s.cq)
    }

    fn finish(self, w: &World) {
        let c = w.call_in_dpc_at::<DestroyQp>(self.s.i, KERNEL, self.qp, &Empty, 0);
        assert_eq!(response::<DestroyQp>(&c).status, IbStatus::Success);
        self.buf.free(w, self.s.i);
        kernel_pair::teardown(w, &self.s);
    }
}

/// Takes the user RC QP and the kernel's to RTS, each aimed at the other.
fn connect(w: &World, user: &User, qp: &UserQp, k: &Kernel) {
    let user_qpn = qp.qp.qpn().get();
    for m in rc_to_rts_steps(1, AccessFlags::REMOTE_WRITE, k.qpn, KERNEL_IP, 1) {
        let c = user.call::<ModifyQp>(w, qp.handle, &m, &[]);
        assert_eq!(response::<ModifyQp>(&c).status, IbStatus::Success);
    }
    for m in rc_to_rts_steps(1, AccessFlags::REMOTE_WRITE, user_qpn, USER_IP, 1) {
        let c = w.call_in_dpc_at::<ModifyQp>(k.s.i, KERNEL, k.qp, &m, 0);
        assert_eq!(response::<ModifyQp>(&c).status, IbStatus::Success);
    }
}

/// Two HCAs; the user on the one with [`USER_IP`], the kernel client on
/// the other.
fn world(seed: u64) -> (World, usize, usize) {
    let (w, [u, k]) = kernel_pair::two_two_port_hcas(seed, GUIDS, &IPS);
    (w, u, k)
}

/// Polls the user CQ until `n` completions arrived (the machine settled
/// already, so they are all there).
#[track_caller]
fn poll_n(cq: &mut Cq, n: usize) -> Vec<WorkCompletion> {
    let mut out = vec![WorkCompletion::EMPTY; n + 4];
    let got = cq.poll(&mut out);
    assert_eq!(got, n, "completions: {:?}", &out[..got]);
    out.truncate(got);
    out
}

fn dropped_doorbells(w: &World, i: usize) -> u32 {
    w.function_at(i)
        .bar0()
        .read32(hca_prm::regs::offset::DROPPED_DOORBELLS)
}

/// Destroys the user's QP and CQ, deregisters its region, closes its
/// context and ends the process with nothing locked.
fn user_teardown(w: &World, user: User, qps: Vec<UserQp>, cqs: Vec<(u64, Cq)>, mr: u64) {
    for qp in qps {
        user.expect::<DestroyQp>(w, qp.handle, &Empty);
    }
    for (handle, _) in cqs {
        user.expect::<DestroyCq>(w, handle, &Empty);
    }
    user.expect::<DeregMr>(w, mr, &Empty);
    user.expect::<CloseCa>(w, user.ca, &Empty);
    assert_eq!(user.process.space().locked_pages(), 0);
    assert_eq!(user.process.space().device_mapping_count(), 0);
    let User { process, ctx, .. } = user;
    drop(ctx);
    assert_eq!(process.exit(), 0);
}

#[test]
fn the_plugin_moves_data_both_ways_with_a_kernel_qp_and_never_calls_the_kernel() {
    data_rounds(150);
}

/// A million post and poll operations (62 500 rounds of 16), every byte
/// checked, no request to the stack; the 16-bit `wqe_index` wraps many
/// times. Long: `cargo test --release -p hca-miniport-core --test
/// uvp_fast_path -- --ignored`.
#[test]
#[ignore = "long: a million operations; run with --release -- --ignored"]
fn a_million_post_and_poll_operations_make_no_request() {
    data_rounds(62_500);
}

/// RC data both ways between the plugin and a kernel QP, `rounds` rounds
/// of 4 receives, 4 sends and their 8 polls, byte-checked; asserts the
/// process sent no request during them.
fn data_rounds(rounds: u32) {
    const BATCH: usize = 4;
    let (w, u, k) = world(91);
    let user = User::open(&w, u, 31);
    let pd = user.alloc_pd(&w);
    let (cq_handle, mut cq) = user.create_cq(&w, 5);
    let mut qp = user.create_qp(&w, QpType::Rc, pd, cq_handle, None);
    let kernel = Kernel::new(&w, k);
    connect(&w, &user, &qp, &kernel);
    let (buf, mr, lkey) = user.register(&w, pd, 1 << 16);
    let slot = |n: usize| buf + (n as u64) * 4096;

    let requests_before = user.process.requests_issued();
    assert!(
        requests_before > 0,
        "the control path went through the stack"
    );
    let mut operations = 0u64;
    let started = std::time::Instant::now();
    for round in 0..rounds {
        // Kernel -> user: a batch of receives in the plugin's ring (one
        // record store), the kernel sends into them.
        let (sq, rq) = qp.qp.queues();
        let lists: Vec<[Sge; 1]> = (0..BATCH)
            .map(|n| [Sge::new(slot(n), 4096, lkey)])
            .collect();
        let recvs: Vec<RecvWr<'_>> = lists
            .iter()
            .enumerate()
            .map(|(n, list)| RecvWr {
                wr_id: u64::from(round) << 8 | n as u64,
                sg_list: list,
            })
            .collect();
        assert_eq!(rq.unwrap().post(&recvs), Ok(BATCH));
        let sizes: Vec<usize> = (0..BATCH)
            .map(|n| 1 + (round as usize * 577 + n * 1013) % 4000)
            .collect();
        let mut at = 0;
        let mut sends = Vec::new();
        for (n, &len) in sizes.iter().enumerate() {
            kernel.buf.write(at, &pattern(round * 16 + n as u32, len));
            sends.push((
                1000 + n as u64,
                kernel.buf.sge(at, len as u32),
                SendFlags::empty(),
            ));
            at += 4096;
        }
        kernel.post_sends(&w, sends);
        let wcs = poll_n(&mut cq, BATCH);
        for (n, wc) in wcs.iter().enumerate() {
            assert_eq!(
                (wc.wr_id, wc.status, wc.opcode, wc.byte_len),
                (
                    u64::from(round) << 8 | n as u64,
                    WcStatus::Success,
                    WcOpcode::Recv,
                    sizes[n] as u32
                )
            );
            assert_eq!(
                user.read(slot(n), sizes[n]),
                pattern(round * 16 + n as u32, sizes[n])
            );
        }
        assert_eq!(kernel.poll(&w).len(), BATCH);

        // User -> kernel: one batch, one doorbell: two sends from the
        // registered buffer and two inline ones (whose bytes are copied
        // into the WQE: no key needed).
        let mut expected = Vec::new();
        let mut krecvs = Vec::new();
        for n in 0..BATCH {
            krecvs.push((2000 + n as u64, kernel.buf.sge(n * 4096, 4096)));
        }
        kernel.post_recvs(&w, krecvs);
        let gathered: Vec<(u64, usize)> = (0..2)
            .map(|n| (slot(8 + n), 100 + (round as usize * 97 + n * 1500) % 3000))
            .collect();
        let gather_lists: Vec<[Sge; 1]> = gathered
            .iter()
            .enumerate()
            .map(|(n, &(va, len))| {
                let bytes = pattern(5000 + round * 4 + n as u32, len);
                user.process.write(va, &bytes).unwrap();
                expected.push(bytes);
                [Sge::new(va, len as u32, lkey)]
            })
            .collect();
        let inline_bytes: Vec<Vec<u8>> = (0..2)
            .map(|n| {
                pattern(
                    9000 + round * 4 + n as u32,
                    8 + (round as usize + n * 29) % 56,
                )
            })
            .collect();
        let inline_lists: Vec<[Sge; 1]> = inline_bytes
            .iter()
            .map(|b| [Sge::new(b.as_ptr() as u64, b.len() as u32, LKey::new(0))])
            .collect();
        expected.extend(inline_bytes.iter().cloned());
        let mut requests: Vec<SendRequest<'_>> = gather_lists
            .iter()
            .enumerate()
            .map(|(n, list)| SendRequest {
                wr: SendWr {
                    wr_id: 7000 + n as u64,
                    op: SendOp::Send,
                    flags: SendFlags::SIGNALED,
                    sg_list: list,
                    ud: None,
                },
                av: None,
                inline: None,
            })
            .collect();
        for (n, list) in inline_lists.iter().enumerate() {
            requests.push(SendRequest {
                wr: SendWr {
                    wr_id: 7002 + n as u64,
                    op: SendOp::Send,
                    flags: SendFlags::SIGNALED | SendFlags::INLINE,
                    sg_list: list,
                    ud: None,
                },
                av: None,
                inline: Some(&inline_bytes[n]),
            });
        }
        assert_eq!(sq.post(&requests), Ok(BATCH));
        w.settle();
        let kwcs = kernel.poll(&w);
        assert_eq!(kwcs.len(), BATCH);
        for (n, wc) in kwcs.iter().enumerate() {
            assert_eq!(
                (wc.wr_id, wc.status, wc.byte_len as usize),
                (2000 + n as u64, WcStatus::Success, expected[n].len())
            );
            assert_eq!(kernel.buf.read(n * 4096, expected[n].len()), expected[n]);
        }
        let wcs = poll_n(&mut cq, BATCH);
        let ids: Vec<(u64, WcStatus, WcOpcode)> = wcs
            .iter()
            .map(|wc| (wc.wr_id, wc.status, wc.opcode))
            .collect();
        assert_eq!(
            ids,
            (0..BATCH as u64)
                .map(|n| (7000 + n, WcStatus::Success, WcOpcode::Send))
                .collect::<Vec<_>>()
        );
        operations += 4 * BATCH as u64;
    }
    // Every ring went round many times: 16 receive WQEs, 16 send BBs
    // (1 or 2 per WQE) and 32 CQEs.
    assert!(qp.qp.send_queue().producer() >= 16 * 10);
    assert!(cq.consumer() >= 32 * 10);
    assert_eq!(cq.stray_completions(), 0);
    // Kernel bypass: the whole data phase sent no request down the stack.
    assert_eq!(user.process.requests_issued(), requests_before);
    println!(
        "{operations} post/poll operations in {:?}, {requests_before} requests before and after",
        started.elapsed()
    );

    user_teardown(&w, user, vec![qp], vec![(cq_handle, cq)], mr);
    kernel.finish(&w);
    w.finish();
}

/// A signaled SEND of `list` (from the registered buffer).
fn send_of(wr_id: u64, list: &[Sge]) -> SendRequest<'_> {
    SendRequest {
        wr: SendWr {
            wr_id,
            op: SendOp::Send,
            flags: SendFlags::SIGNALED,
            sg_list: list,
            ud: None,
        },
        av: None,
        inline: None,
    }
}

#[test]
fn refused_posts_leave_the_rings_consistent_and_traffic_goes_on() {
    let (w, u, k) = world(92);
    let user = User::open(&w, u, 32);
    let pd = user.alloc_pd(&w);
    let (cq_handle, mut cq) = user.create_cq(&w, 6);
    let mut qp = user.create_qp(&w, QpType::Rc, pd, cq_handle, None);
    let kernel = Kernel::new(&w, k);
    connect(&w, &user, &qp, &kernel);
    let (buf, mr, lkey) = user.register(&w, pd, 1 << 16);
    let payload = |n: u32| pattern(300 + n, 64 + n as usize);
    for n in 0..24u32 {
        user.process
            .write(buf + u64::from(n) * 256, &payload(n))
            .unwrap();
    }
    let lists: Vec<[Sge; 1]> = (0..24u32)
        .map(|n| [Sge::new(buf + u64::from(n) * 256, 64 + n, lkey)])
        .collect();
    let requests_before = user.process.requests_issued();
    let sq = qp.qp.send_queue();

    // A request in the middle of a batch breaks a rule: the ones before it
    // are posted and rung, it and the ones after are not in the ring.
    let eight: Vec<Sge> = (0..8).map(|n| lists[n][0]).collect();
    let too_long = vec![0u8; 200];
    let too_long_sge = [Sge::new(too_long.as_ptr() as u64, 200, LKey::new(0))];
    let inline_too_long = SendRequest {
        wr: SendWr {
            flags: SendFlags::SIGNALED | SendFlags::INLINE,
            ..send_of(0, &too_long_sge).wr
        },
        inline: Some(&too_long),
        ..send_of(0, &too_long_sge)
    };
    let mismatched_inline = SendRequest {
        inline: Some(&too_long[..10]),
        ..inline_too_long
    };
    let cases: [(SendRequest<'_>, IbStatus); 3] = [
        (send_of(0, &eight), IbStatus::InvalidMaxSge),
        (inline_too_long, IbStatus::InvalidParameter),
        (mismatched_inline, IbStatus::InvalidParameter),
    ];
    kernel.post_recvs(
        &w,
        (0..16)
            .map(|n| (n, kernel.buf.sge(n as usize * 256, 256)))
            .collect(),
    );
    let mut delivered = 0u64;
    for (bad, status) in cases {
        let before = sq.producer();
        let batch = [
            send_of(delivered, &lists[delivered as usize]),
            bad,
            send_of(99, &lists[23]),
        ];
        let refused = sq.post(&batch).unwrap_err();
        assert_eq!((refused.posted, refused.status()), (1, status), "{refused}");
        assert_eq!(
            sq.producer(),
            before + 1,
            "one basic block, nothing of the rest"
        );
        delivered += 1;
    }
    let refused = sq.post(&[send_of(0, &eight)]).unwrap_err();
    assert!(
        matches!(
            refused.kind,
            PostErrorKind::Request(WrError::TooManySge { count: 8, .. })
        ),
        "{refused:?}"
    );
    w.settle();
    // Exactly the good ones arrived, in order, byte for byte.
    let kwcs = kernel.poll(&w);
    assert_eq!(kwcs.len(), delivered as usize);
    for (n, wc) in kwcs.iter().enumerate() {
        assert_eq!((wc.wr_id, wc.status), (n as u64, WcStatus::Success));
        assert_eq!(
            kernel.buf.read(n * 256, wc.byte_len as usize),
            payload(n as u32)
        );
    }
    let wcs = poll_n(&mut cq, delivered as usize);
    assert!(wcs.iter().enumerate().all(|(n, wc)| wc.wr_id == n as u64));

    // The send ring is full with 16 basic blocks in flight: a batch of 17
    // posts 16 and refuses the 17th; the 16 arrive in order, and once
    // their completions are polled the 17th goes through.
    kernel.post_recvs(
        &w,
        (16..19)
            .map(|n| (n, kernel.buf.sge(n as usize * 256, 256)))
            .collect(),
    );
    let sq = qp.qp.send_queue();
    let batch: Vec<SendRequest<'_>> = (0..17)
        .map(|n| send_of(100 + n as u64, &lists[n]))
        .collect();
    let refused = sq.post(&batch).unwrap_err();
    assert_eq!(
        (refused.posted, refused.kind, refused.status()),
        (
            16,
            PostErrorKind::QueueFull,
            IbStatus::InsufficientResources
        )
    );
    w.settle();
    let kwcs = kernel.poll(&w);
    assert_eq!(kwcs.len(), 16);
    for (n, wc) in kwcs.iter().enumerate() {
        let at = (3 + n) * 256;
        assert_eq!((wc.wr_id, wc.status), (3 + n as u64, WcStatus::Success));
        assert_eq!(kernel.buf.read(at, wc.byte_len as usize), payload(n as u32));
    }
    let wcs = poll_n(&mut cq, 16);
    assert!(
        wcs.iter()
            .enumerate()
            .all(|(n, wc)| wc.wr_id == 100 + n as u64)
    );
    kernel.post_recvs(&w, vec![(19, kernel.buf.sge(19 * 256, 256))]);
    assert_eq!(qp.qp.send_queue().post(&batch[16..]), Ok(1));
    w.settle();
    let kwcs = kernel.poll(&w);
    assert_eq!(
        (kwcs.len(), kwcs[0].wr_id, kwcs[0].byte_len),
        (1, 19, 64 + 16)
    );
    assert_eq!(poll_n(&mut cq, 1)[0].wr_id, 116);

    // Receives: more SGEs than the stride holds, and a full ring.
    let rq = qp.qp.recv_queue().unwrap();
    let four: Vec<Sge> = (0..4).map(|n| lists[n][0]).collect();
    let refused = rq
        .post(&[RecvWr {
            wr_id: 1,
            sg_list: &four,
        }])
        .unwrap_err();
    assert_eq!(
        (refused.posted, refused.status()),
        (0, IbStatus::InvalidMaxSge)
    );
    let recvs: Vec<RecvWr<'_>> = (0..17)
        .map(|n| RecvWr {
            wr_id: 500 + n as u64,
            sg_list: &lists[n],
        })
        .collect();
    let refused = rq.post(&recvs).unwrap_err();
    assert_eq!(
        (refused.posted, refused.kind),
        (16, PostErrorKind::QueueFull)
    );
    // The 16 are there, in order: the kernel fills them.
    kernel.post_sends(
        &w,
        (0..16)
            .map(|n| (600 + n, kernel.buf.sge(0, 8 + n as u32), SendFlags::empty()))
            .collect(),
    );
    let wcs = poll_n(&mut cq, 16);
    for (n, wc) in wcs.iter().enumerate() {
        assert_eq!((wc.wr_id, wc.byte_len), (500 + n as u64, 8 + n as u32));
    }
    assert_eq!(kernel.poll(&w).len(), 16);

    // A UD QP refuses an operation its transport does not have and a send
    // without its destination, before touching its ring.
    let mut ud = user.create_qp(&w, QpType::Ud, pd, cq_handle, None);
    let write = SendRequest {
        wr: SendWr {
            op: SendOp::RdmaWrite {
                remote: ib_types::wr::RemoteAddr {
                    addr: 0x1000,
                    rkey: ib_types::wr::RKey::new(1),
                },
            },
            ..send_of(1, &lists[0]).wr
        },
        ..send_of(1, &lists[0])
    };
    let sq = ud.qp.send_queue();
    assert_eq!(
        sq.post(&[write]).unwrap_err().status(),
        IbStatus::InvalidWrType
    );
    assert_eq!(
        sq.post(&[send_of(2, &lists[0])]).unwrap_err().kind,
        PostErrorKind::Request(WrError::MissingUdDest)
    );
    assert_eq!(sq.producer(), 0);

    assert_eq!(cq.stray_completions(), 0);
    assert_eq!(
        user.process.requests_issued(),
        requests_before + 1,
        "the UD create only"
    );
    user_teardown(&w, user, vec![qp, ud], vec![(cq_handle, cq)], mr);
    kernel.finish(&w);
    w.finish();
}

/// Sends `V` (no input) down the stack for `user` and returns at once: the
/// request may stay pending.
fn user_request_pending<V: Verb<In = Empty>>(
    w: &World,
    user: &User,
    handle: u64,
) -> sim_host::request::RequestHandle {
    let mut bytes = vec![0; request_len::<V>(0).unwrap()];
    encode_request::<V>(handle, &Empty, &[], 0, &mut bytes).unwrap();
    let (mut request, issuer) = w.raw_request(
        V::ID.ioctl().raw(),
        RequestorMode::User,
        bytes,
        response_len::<V>(0).unwrap(),
    );
    request.set_process(user.process.clone());
    w.host
        .pnp()
        .send_request(w.device_at(user.i).node(), request);
    w.settle();
    issuer
}

#[test]
fn srq_receives_arming_and_another_processs_doorbell_page() {
    let (w, u, k) = world(93);
    let user = User::open(&w, u, 33);
    let pd = user.alloc_pd(&w);
    let (cq_handle, mut cq) = user.create_cq(&w, 4);
    let (srq_handle, mut srq) = user.create_srq(&w, pd);
    let mut qp = user.create_qp(&w, QpType::Rc, pd, cq_handle, Some((srq_handle, &srq)));
    let kernel = Kernel::new(&w, k);
    connect(&w, &user, &qp, &kernel);
    let (buf, mr, lkey) = user.register(&w, pd, 1 << 16);
    let requests_before = user.process.requests_issued();
    let lists: Vec<[Sge; 1]> = (0..9u64)
        .map(|n| [Sge::new(buf + n * 4096, 4096, lkey)])
        .collect();

    // SRQ receives: 8 slots, 12 rounds of 3 go round it 4 times.
    for round in 0..12u32 {
        let recvs: Vec<RecvWr<'_>> = (0..3)
            .map(|n| RecvWr {
                wr_id: u64::from(round) * 10 + n as u64,
                sg_list: &lists[n],
            })
            .collect();
        assert_eq!(srq.post(&recvs), Ok(3));
        let sends = (0..3)
            .map(|n| {
                let len = 10 + (round as usize * 131 + n * 7) % 4000;
                kernel
                    .buf
                    .write(n * 4096, &pattern(round * 3 + n as u32, len));
                (
                    n as u64,
                    kernel.buf.sge(n * 4096, len as u32),
                    SendFlags::empty(),
                )
            })
            .collect();
        kernel.post_sends(&w, sends);
        for (n, wc) in poll_n(&mut cq, 3).iter().enumerate() {
            assert_eq!(
                (wc.wr_id, wc.status, wc.opcode),
                (
                    u64::from(round) * 10 + n as u64,
                    WcStatus::Success,
                    WcOpcode::Recv
                )
            );
            let len = wc.byte_len as usize;
            assert_eq!(
                user.read(lists[n][0].addr.get(), len),
                pattern(round * 3 + n as u32, len)
            );
        }
        assert_eq!(kernel.poll(&w).len(), 3);
    }
    // Full: a slot whose WQE has not completed is not reused.
    let nine: Vec<RecvWr<'_>> = (0..9)
        .map(|n| RecvWr {
            wr_id: 900 + n as u64,
            sg_list: &lists[n],
        })
        .collect();
    let refused = srq.post(&nine).unwrap_err();
    assert_eq!(
        (refused.posted, refused.kind),
        (8, PostErrorKind::QueueFull)
    );
    kernel.post_sends(
        &w,
        (0..8)
            .map(|n| (n, kernel.buf.sge(0, 16), SendFlags::empty()))
            .collect(),
    );
    let ids: Vec<u64> = poll_n(&mut cq, 8).iter().map(|wc| wc.wr_id).collect();
    assert_eq!(ids, (900..908).collect::<Vec<_>>());
    assert_eq!(kernel.poll(&w).len(), 8);
    assert_eq!(user.process.requests_issued(), requests_before);

    // Arming through the doorbell page: a completion wakes a wait armed
    // for the next one; one armed for solicited completions sleeps through
    // a plain send and wakes on a solicited one.
    assert_eq!(srq.post(&nine[..3]), Ok(3));
    cq.arm(ArmFor::Next);
    let waiting = user_request_pending::<WaitCqEvent>(&w, &user, cq_handle);
    assert!(!waiting.is_done());
    kernel.post_sends(&w, vec![(1, kernel.buf.sge(0, 8), SendFlags::empty())]);
    assert!(waiting.is_done(), "the next completion raised the event");
    assert_eq!(poll_n(&mut cq, 1)[0].wr_id, 900);
    cq.arm(ArmFor::Solicited);
    let waiting = user_request_pending::<WaitCqEvent>(&w, &user, cq_handle);
    kernel.post_sends(&w, vec![(2, kernel.buf.sge(0, 8), SendFlags::empty())]);
    assert!(!waiting.is_done(), "not solicited");
    assert_eq!(poll_n(&mut cq, 1)[0].wr_id, 901);
    kernel.post_sends(&w, vec![(3, kernel.buf.sge(0, 8), SendFlags::SOLICITED)]);
    assert!(waiting.is_done(), "solicited");
    assert_eq!(poll_n(&mut cq, 1)[0].wr_id, 902);
    assert_eq!(kernel.poll(&w).len(), 3);

    // Another process's doorbell page names this QP and this CQ: the
    // device checks the page against the QP's and the CQ's (PRM 9.1) and
    // drops both. Were the send doorbell honoured, the device would run
    // the zeroed slot 0 and fail the QP.
    let other = User::open(&w, u, 34);
    assert_ne!(other.doorbell, user.doorbell);
    let dropped = dropped_doorbells(&w, u);
    let victim = SqDoorbell {
        qpn: qp.qp.qpn(),
        producer: qp.qp.send_queue().producer() + 1,
    };
    assert!(other.ctx.uar_page().write64(SQ_DOORBELL, victim.encode()));
    let arm = CqDoorbell::new(cq.cqn(), CqArm::Next, cq.consumer()).unwrap();
    assert!(other.ctx.uar_page().write64(CQ_DOORBELL, arm.encode()));
    w.settle();
    assert_eq!(dropped_doorbells(&w, u), dropped + 2);
    assert_eq!(cq.poll(&mut [WorkCompletion::EMPTY; 4]), 0);
    assert!(kernel.poll(&w).is_empty(), "nothing was sent");
    // The owner's page still rings it: one send arrives intact.
    kernel.post_recvs(&w, vec![(77, kernel.buf.sge(0, 4096))]);
    user.process.write(buf, b"still connected").unwrap();
    let list = [Sge::new(buf, 15, lkey)];
    assert_eq!(qp.qp.send_queue().post(&[send_of(5, &list)]), Ok(1));
    w.settle();
    let kwcs = kernel.poll(&w);
    assert_eq!(
        (kwcs.len(), kwcs[0].wr_id, kwcs[0].status),
        (1, 77, WcStatus::Success)
    );
    assert_eq!(kernel.buf.read(0, 15), b"still connected");
    assert_eq!(poll_n(&mut cq, 1)[0].wr_id, 5);
    assert_eq!(cq.stray_completions(), 0);

    other.expect::<CloseCa>(&w, other.ca, &Empty);
    assert_eq!(other.process.exit(), 0);
    user.expect::<DestroyQp>(&w, qp.handle, &Empty);
    drop(qp);
    user.expect::<DestroySrq>(&w, srq_handle, &Empty);
    drop(srq);
    user_teardown(&w, user, vec![], vec![(cq_handle, cq)], mr);
    kernel.finish(&w);
    w.finish();
}

/// Post and poll on two OS threads at once, with no lock between them: on
/// a threaded host (devices run on the threads that touch them), one
/// thread posts RDMA writes to a kernel region on the other HCA in
/// batches, spinning while the send ring is full, while another polls the
/// CQ. Every `wr_id` comes back once and in order, the written region holds
/// every slot's bytes, and the process sends no request meanwhile.
#[test]
fn one_thread_posts_while_another_polls() {
    const WRITES: u64 = 4000;
    const SLOTS: u64 = 64;
    const MSG: usize = 64;
    let w = World::threaded_with_hcas(
        2,
        vec![
            sim_hca::device::DeviceConfig::with_ports(GUIDS[0], &IPS[0]),
            sim_hca::device::DeviceConfig::with_ports(GUIDS[1], &IPS[1]),
        ],
        hca_miniport_core::init::HcaConfig::default(),
    );
    let guid = |i: usize| w.hca_at(i).report().unwrap().capabilities.node_guid.get();
    let u = if guid(0) == GUIDS[0] { 0 } else { 1 };
    let k = 1 - u;

    // The kernel side: a CA, PD, CQ, RC QP and a region it lets the peer
    // write.
    let r = w.call_in_dpc_waiting_at::<OpenCa>(k, KERNEL, 0, &OpenCaIn::CURRENT, 0);
    let kca = response::<OpenCa>(&r).handle;
    let r = w.call_in_dpc_waiting_at::<AllocPd>(k, KERNEL, kca, &Empty, 0);
    let kpd = response::<AllocPd>(&r).handle;
    let attr = CqAttr {
        cqe: 64,
        comp_vector: 0,
    };
    let r = w.call_in_dpc_waiting_at::<CreateCq>(k, KERNEL, kca, &attr, 0);
    let kcq = response::<CreateCq>(&r).handle;
    let input = support::small_qp_create(QpType::Rc, kpd, kcq);
    let r = w.call_in_dpc_waiting_at::<CreateQp>(k, KERNEL, kca, &input, 0);
    let (kqp, kqpn) = (
        response::<CreateQp>(&r).handle,
        response::<CreateQp>(&r).output.unwrap().qpn.get(),
    );
    let block = w
        .host
        .pool()
        .alloc(support::DRIVER, *b"UvpT", (SLOTS as usize) * MSG)
        .unwrap();
    let reg = ib_types::mr::MrRegister {
        vaddr: block.va(),
        length: SLOTS * MSG as u64,
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
    };
    let r = w.call_in_dpc_waiting_at::<RegMr>(k, KERNEL, kpd, &reg, 0);
    let (kmr, rkey) = (
        response::<RegMr>(&r).handle,
        response::<RegMr>(&r).output.unwrap().rkey,
    );

    // The user side, its control calls down the stack.
    let user = User::open(&w, u, 35);
    let pd = user.alloc_pd(&w);
    let (cq_handle, mut cq) = user.create_cq(&w, 6);
    let mut qp = user.create_qp(&w, QpType::Rc, pd, cq_handle, None);
    for m in rc_to_rts_steps(1, AccessFlags::REMOTE_WRITE, kqpn, KERNEL_IP, 1) {
        let c = user.call::<ModifyQp>(&w, qp.handle, &m, &[]);
        assert_eq!(response::<ModifyQp>(&c).status, IbStatus::Success);
    }
    for m in rc_to_rts_steps(1, AccessFlags::REMOTE_WRITE, qp.qp.qpn().get(), USER_IP, 1) {
        let c = w.call_in_dpc_waiting_at::<ModifyQp>(k, KERNEL, kqp, &m, 0);
        assert_eq!(response::<ModifyQp>(&c).status, IbStatus::Success);
    }
    let (buf, mr, lkey) = user.register(&w, pd, (SLOTS as usize) * MSG);
    for slot in 0..SLOTS {
        user.process
            .write(buf + slot * MSG as u64, &pattern(slot as u32, MSG))
            .unwrap();
    }
    let lists: Vec<[Sge; 1]> = (0..SLOTS)
        .map(|slot| [Sge::new(buf + slot * MSG as u64, MSG as u32, lkey)])
        .collect();
    let requests_before = user.process.requests_issued();

    let started = std::time::Instant::now();
    let sq = qp.qp.send_queue();
    let (full, polled) = std::thread::scope(|scope| {
        let poster = scope.spawn(|| {
            let mut next = 0u64;
            let mut full = 0u64;
            while next < WRITES {
                let batch: Vec<SendRequest<'_>> = (next..WRITES.min(next + 4))
                    .map(|n| {
                        let slot = n % SLOTS;
                        SendRequest {
                            wr: SendWr {
                                wr_id: n,
                                op: SendOp::RdmaWrite {
                                    remote: ib_types::wr::RemoteAddr {
                                        addr: block.va() + slot * MSG as u64,
                                        rkey,
                                    },
                                },
                                flags: SendFlags::SIGNALED,
                                sg_list: &lists[slot as usize],
                                ud: None,
                            },
                            av: None,
                            inline: None,
                        }
                    })
                    .collect();
                match sq.post(&batch) {
                    Ok(posted) => next += posted as u64,
                    Err(e) if e.kind == PostErrorKind::QueueFull => {
                        next += e.posted as u64;
                        full += 1;
                        std::thread::yield_now();
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            full
        });
        let poller = scope.spawn(|| {
            let mut next = 0u64;
            let mut wcs = [WorkCompletion::EMPTY; 16];
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
            while next < WRITES {
                let n = cq.poll(&mut wcs);
                for wc in &wcs[..n] {
                    assert_eq!((wc.wr_id, wc.status), (next, WcStatus::Success));
                    next += 1;
                }
                if n == 0 {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "{next} of {WRITES} completed"
                    );
                    std::thread::yield_now();
                }
            }
            next
        });
        (poster.join().unwrap(), poller.join().unwrap())
    });
    println!(
        "{WRITES} RDMA writes posted and polled on two threads in {:?}; the poster found the ring full {full} times",
        started.elapsed()
    );
    assert_eq!(polled, WRITES);
    for slot in 0..SLOTS {
        let mut got = vec![0; MSG];
        assert!(block.read((slot as usize) * MSG, &mut got));
        assert_eq!(got, pattern(slot as u32, MSG), "slot {slot}");
    }
    assert_eq!(cq.stray_completions(), 0);
    assert_eq!(user.process.requests_issued(), requests_before);

    user_teardown(&w, user, vec![qp], vec![(cq_handle, cq)], mr);
    for (verb, handle) in [(0, kqp), (1, kmr), (2, kcq), (3, kpd), (4, kca)] {
        let c = match verb {
            0 => w.call_in_dpc_waiting_at::<DestroyQp>(k, KERNEL, handle, &Empty, 0),
            1 => w.call_in_dpc_waiting_at::<DeregMr>(k, KERNEL, handle, &Empty, 0),
            2 => w.call_in_dpc_waiting_at::<DestroyCq>(k, KERNEL, handle, &Empty, 0),
            3 => {
                w.call_in_dpc_waiting_at::<ib_types::ioctl::DeallocPd>(k, KERNEL, handle, &Empty, 0)
            }
            _ => w.call_in_dpc_waiting_at::<CloseCa>(k, KERNEL, handle, &Empty, 0),
        };
        assert_eq!(c.status, ib_types::status::NtStatus::SUCCESS);
    }
    w.host.pool().free(block);
    w.finish();
}
