//! A user QP moved to RESET through the UVP's hooks (guide 6.5.4 NOTE,
//! 6.5.5 items 3-5; PRM 6.1.3): after a successful modify to RESET the
//! provider's rings restart from the first WQE exactly as the device does,
//! completions already in the CQ from before the reset still poll with
//! their own `wr_id`s, other QPs on the same CQ are unaffected, and a
//! failed RESET modify leaves the rings as they were. The provider
//! (`uvp_plugin::Provider`) runs against the real miniport on the
//! simulated host; each verb is pre, the process's proxy IOCTL, then post.

mod support;

use std::sync::Arc;

use driver_platform::RequestorMode;
use hca_miniport_core::verbs::qp::QPN_QUIET_PERIOD_NS;
use ib_types::abi::Repr;
use ib_types::access::AccessFlags;
use ib_types::cq::CqAttr;
use ib_types::handle::{CqHandle, PdHandle};
use ib_types::ioctl::{
    AllocPd, CloseCa, CreateCq, CreateQp, DeallocPd, DeregMr, DestroyCq, DestroyQp, Empty,
    ModifyQp, OpenCa, OpenCaIn, RegMr, Verb, decode_response, encode_request, request_len,
    response_len,
};
use ib_types::mr::MrRegister;
use ib_types::qp::{QpCaps, QpCreate, QpModify, QpState, QpType};
use ib_types::status::IbStatus;
use ib_types::uvp::{PostCall, PreCall, PreOutcome, UserSend, UserVerbsProvider};
use ib_types::wc::{WcStatus, WorkCompletion};
use ib_types::wr::{LKey, RecvWr, SendFlags, SendOp, SendWr, Sge};
use sim_host::memory::Process;
use support::World;
use support::kernel_pair;
use support::rc_path::rc_to_rts_steps;
use uvp_plugin::{Platform, Provider, UserMemory};
use zerocopy::IntoBytes;

const GUIDS: [u64; 2] = [0x0002_C900_0000_7100, 0x0002_C900_0000_8100];
const IPS: [[[u8; 4]; 2]; 2] = [
    [[10, 0, 0, 1], [10, 0, 1, 1]],
    [[10, 0, 2, 1], [10, 0, 3, 1]],
];

/// Deterministic, non-trivial bytes.
fn pattern(seed: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(29).wrapping_add(seed * 11) as u8)
        .collect()
}

/// The process's memory as the provider allocates it.
struct SimMemory(Process);

impl UserMemory for SimMemory {
    fn alloc(&self, len: usize) -> Option<u64> {
        self.0.alloc(len).ok()
    }

    fn free(&self, va: u64) {
        self.0
            .free(va)
            .expect("the provider frees its own allocation");
    }
}

/// One process on HCA `hca` with its provider.
struct User<'a> {
    w: &'a World,
    hca: usize,
    process: Process,
    uvp: Provider,
}

impl<'a> User<'a> {
    fn new(w: &'a World, hca: usize, pid: u32) -> Self {
        let process = Process::new(pid);
        let mapped = process.clone();
        let uvp = Provider::new(Platform {
            memory: Arc::new(SimMemory(process.clone())),
            // The simulator's side of the doorbell: the store reaches the
            // device in the calling thread.
            mmio: Arc::new(move |address, value| {
                let _ = mapped.write_device64(address, value);
            }),
        });
        Self {
            w,
            hca,
            process,
            uvp,
        }
    }

    /// One verb as Table 10-1 says: pre, the IOCTL, post with its status.
    /// `Err` is the status of the first step that failed (post must report
    /// a failed IOCTL's own status).
    fn call<V: Verb>(&self, handle: u64, input: &V::In) -> Result<(u64, V::Out), IbStatus> {
        let in_abi = input.emit();
        let mut private_in = vec![0u8; 256];
        let mut output = vec![0u8; V::ID.out_size()];
        let mut pre = PreCall {
            verb: V::ID,
            handle,
            input: in_abi.as_bytes(),
            private_in: &mut private_in,
            output: &mut output,
        };
        let PreOutcome::Ioctl {
            private_in_len,
            private_out_max,
            cookie,
        } = self.uvp.pre(&mut pre)?
        else {
            panic!("{:?} completes in the kernel", V::ID);
        };
        let private = &private_in[..private_in_len];
        let mut bytes = vec![0; request_len::<V>(private.len()).unwrap()];
        encode_request::<V>(handle, input, private, private_out_max as u32, &mut bytes).unwrap();
        let (mut request, issuer) = self.w.raw_request(
            V::ID.ioctl().raw(),
            RequestorMode::User,
            bytes,
            response_len::<V>(private_out_max).unwrap(),
        );
        request.set_process(self.process.clone());
        self.w
            .host
            .pnp()
            .send_request(self.w.device_at(self.hca).node(), request);
        self.w.settle();
        let done = issuer.completion().expect("the request completed");
        let status = IbStatus::from_ntstatus(done.status);
        let (created, out, private_out) = if status == IbStatus::Success {
            let raw = &done.output[..done.information as usize];
            let r = decode_response::<V>(raw).expect("a valid response");
            let fixed = 16..16 + V::ID.out_size();
            (r.handle, raw[fixed].to_vec(), r.private.to_vec())
        } else {
            (0, vec![0; V::ID.out_size()], Vec::new())
        };
        let post = PostCall {
            verb: V::ID,
            handle,
            input: in_abi.as_bytes(),
            private_in: private,
            cookie,
            status,
            created,
            output: &out,
            private_out: &private_out,
        };
        let posted = self.uvp.post(&post);
        if status != IbStatus::Success {
            assert_eq!(posted, Err(status), "post reports the IOCTL's status");
            return Err(status);
        }
        posted?;
        Ok((created, V::Out::decode(&out).unwrap().0))
    }

    #[track_caller]
    fn ok<V: Verb>(&self, handle: u64, input: &V::In) -> (u64, V::Out) {
        self.call::<V>(handle, input)
            .unwrap_or_else(|status| panic!("{:?}: {status:?}", V::ID))
    }

    fn modify(&self, qp: u64, steps: &[QpModify]) {
        for step in steps {
            self.ok::<ModifyQp>(qp, step);
        }
    }

    fn rc_qp(&self, ca: u64, pd: u64, cq: u64) -> (u64, u32) {
        let (handle, out) = self.ok::<CreateQp>(ca, &rc_create(pd, cq));
        (handle, out.qpn.get())
    }

    fn register(&self, pd: u64, len: usize) -> (u64, u64, LKey) {
        let va = self.process.alloc(len).unwrap();
        let input = MrRegister {
            vaddr: va,
            length: len as u64,
            access: AccessFlags::LOCAL_WRITE,
        };
        let (mr, keys) = self.ok::<RegMr>(pd, &input);
        (va, mr, keys.lkey)
    }

    /// Posts one signaled send of `len` bytes at `va`.
    fn send(&self, qp: u64, wr_id: u64, va: u64, len: u32, lkey: LKey) {
        let sge = [Sge::new(va, len, lkey)];
        let wr = SendWr {
            wr_id,
            op: SendOp::Send,
            flags: SendFlags::SIGNALED,
            sg_list: &sge,
            ud: None,
        };
        let sends = [UserSend { wr, inline: None }];
        assert_eq!(self.uvp.post_send(qp, &sends), Ok(1));
    }

    /// Posts one receive of `len` bytes at `va`.
    fn recv(&self, qp: u64, wr_id: u64, va: u64, len: u32, lkey: LKey) {
        let sge = [Sge::new(va, len, lkey)];
        let wrs = [RecvWr {
            wr_id,
            sg_list: &sge,
        }];
        assert_eq!(self.uvp.post_recv(qp, &wrs), Ok(1));
    }

    /// Every completion waiting in `cq`: `(wr_id, status, byte_len)`.
    fn poll(&self, cq: u64) -> Vec<(u64, WcStatus, u32)> {
        let mut out = vec![WorkCompletion::EMPTY; 32];
        let got = self.uvp.poll_cq(cq, &mut out).unwrap();
        out[..got]
            .iter()
            .map(|wc| (wc.wr_id, wc.status, wc.byte_len))
            .collect()
    }

    fn read(&self, va: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0; len];
        self.process.read(va, &mut out).unwrap();
        out
    }
}

/// An RC QP of `pd` on `cq`: 8 WRs and one SGE each way.
fn rc_create(pd: u64, cq: u64) -> QpCreate {
    QpCreate {
        qp_type: QpType::Rc,
        pd: PdHandle::from_raw(pd),
        send_cq: CqHandle::from_raw(cq),
        recv_cq: CqHandle::from_raw(cq),
        srq: None,
        caps: QpCaps {
            max_send_wr: 8,
            max_recv_wr: 8,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        sq_sig_all: false,
        port: None,
    }
}

/// One side: a context, a PD, one CQ, two RC QPs on it, a 16 KiB region.
struct Side {
    ca: u64,
    pd: u64,
    mr: u64,
    cq: u64,
    qps: [(u64, u32); 2],
    buf: u64,
    lkey: LKey,
}

fn side(user: &User<'_>) -> Side {
    let ca = user.ok::<OpenCa>(0, &OpenCaIn::CURRENT).0;
    let pd = user.ok::<AllocPd>(ca, &Empty).0;
    let attr = CqAttr {
        cqe: 64,
        comp_vector: 0,
    };
    let cq = user.ok::<CreateCq>(ca, &attr).0;
    let qps = [user.rc_qp(ca, pd, cq), user.rc_qp(ca, pd, cq)];
    let (buf, mr, lkey) = user.register(pd, 1 << 14);
    Side {
        ca,
        pd,
        mr,
        cq,
        qps,
        buf,
        lkey,
    }
}

/// Destroys every object of `side` through the hooks and ends the
/// process: nothing of it stays allocated, locked or mapped.
fn teardown(user: User<'_>, side: Side) {
    for (qp, _) in side.qps {
        user.ok::<DestroyQp>(qp, &Empty);
    }
    user.ok::<DestroyCq>(side.cq, &Empty);
    user.ok::<DeregMr>(side.mr, &Empty);
    user.ok::<DeallocPd>(side.pd, &Empty);
    user.ok::<CloseCa>(side.ca, &Empty);
    assert_eq!(user.uvp.allocations(), 0);
    assert_eq!(user.process.exit(), 0);
}

fn connect(user: &User<'_>, qp: u64, peer_qpn: u32, peer_ip: [u8; 4]) {
    user.modify(
        qp,
        &rc_to_rts_steps(1, AccessFlags::empty(), peer_qpn, peer_ip, 1),
    );
}

/// Traffic on both of A's QPs, a failed and then a successful RESET of QP
/// 0 with its completions (and QP 1's) still in the CQ, those polled with
/// their `wr_id`s after new receives were posted over their slots, then
/// QP 0 reconnected and byte-checked traffic from slot 0 both ways.
#[test]
fn a_reset_restarts_the_rings_and_earlier_completions_still_poll() {
    let (w, [a_hca, b_hca]) = kernel_pair::two_two_port_hcas(31, GUIDS, &IPS);
    let a = User::new(&w, a_hca, 71);
    let b = User::new(&w, b_hca, 72);
    let sa = side(&a);
    let sb = side(&b);
    for n in 0..2 {
        connect(&a, sa.qps[n].0, sb.qps[n].1, IPS[b_hca][0]);
        connect(&b, sb.qps[n].0, sa.qps[n].1, IPS[a_hca][0]);
    }
    let (a0, a1) = (sa.qps[0].0, sa.qps[1].0);
    let (b0, b1) = (sb.qps[0].0, sb.qps[1].0);

    // Before the reset: A sends three messages on QP 0 and one on QP 1, and
    // receives two on QP 0 (a third receive stays outstanding); nothing of
    // A's CQ is polled.
    for n in 0..4u64 {
        b.recv(
            if n < 3 { b0 } else { b1 },
            100 + n,
            sb.buf + n * 1024,
            1024,
            sb.lkey,
        );
    }
    for n in 0..3u64 {
        a.recv(a0, 200 + n, sa.buf + 8192 + n * 1024, 1024, sa.lkey);
    }
    for n in 0..4u64 {
        a.process
            .write(sa.buf + n * 1024, &pattern(n as u32, 1000))
            .unwrap();
        a.send(
            if n < 3 { a0 } else { a1 },
            10 + n,
            sa.buf + n * 1024,
            1000,
            sa.lkey,
        );
    }
    for n in 0..2u64 {
        b.process
            .write(sb.buf + 4096 + n * 1024, &pattern(40 + n as u32, 500))
            .unwrap();
        b.send(b0, 50 + n, sb.buf + 4096 + n * 1024, 500, sb.lkey);
    }
    w.settle();
    assert_eq!(b.poll(sb.cq).len(), 6, "B's side completed");

    // A RESET modify the kernel refuses (A's QP is not in INIT) changes
    // nothing: the rings go on where they were.
    let refused = QpModify {
        cur_state: Some(QpState::Init),
        ..QpModify::to_state(QpState::Reset)
    };
    assert!(a.call::<ModifyQp>(a0, &refused).is_err());
    b.recv(b0, 103, sb.buf + 5120, 1024, sb.lkey);
    a.process.write(sa.buf + 5120, &pattern(14, 1000)).unwrap();
    a.send(a0, 14, sa.buf + 5120, 1000, sa.lkey);
    w.settle();
    assert_eq!(b.poll(sb.cq), [(103, WcStatus::Success, 1000)]);
    assert_eq!(b.read(sb.buf + 5120, 1000), pattern(14, 1000));

    // The real RESET of A's QP 0 (and B's, to reconnect them). Its two
    // receives and three sends are still in A's CQ with QP 1's send.
    a.modify(a0, &[QpModify::to_state(QpState::Reset)]);
    b.modify(b0, &[QpModify::to_state(QpState::Reset)]);
    // A connected QP's number is quiet for a while after its reset.
    w.host.scheduler().advance(QPN_QUIET_PERIOD_NS).unwrap();
    // New receives restart at slot 0, over the slots whose completions
    // have not been polled yet.
    a.modify(
        a0,
        &rc_to_rts_steps(1, AccessFlags::empty(), sb.qps[0].1, IPS[b_hca][0], 1)[..1],
    );
    for n in 0..2u64 {
        a.recv(a0, 300 + n, sa.buf + 12288 + n * 1024, 1024, sa.lkey);
    }
    let mut before = a.poll(sa.cq);
    before.sort_unstable_by_key(|c| c.0);
    assert_eq!(
        before,
        [
            (10, WcStatus::Success, 1000),
            (11, WcStatus::Success, 1000),
            (12, WcStatus::Success, 1000),
            (13, WcStatus::Success, 1000),
            (14, WcStatus::Success, 1000),
            (200, WcStatus::Success, 500),
            (201, WcStatus::Success, 500),
        ],
        "the completions from before the reset, with their wr_ids"
    );
    for n in 0..2u64 {
        assert_eq!(
            a.read(sa.buf + 8192 + n * 1024, 500),
            pattern(40 + n as u32, 500)
        );
    }
    for n in 0..4u64 {
        assert_eq!(
            b.read(sb.buf + n * 1024, 1000),
            pattern(n as u32, 1000),
            "B's receive {n}"
        );
    }

    // Reconnected, QP 0 moves data again from its first WQE, both ways.
    let rest = &rc_to_rts_steps(1, AccessFlags::empty(), sb.qps[0].1, IPS[b_hca][0], 1)[1..];
    a.modify(a0, rest);
    connect(&b, b0, sa.qps[0].1, IPS[a_hca][0]);
    for n in 0..2u64 {
        b.recv(b0, 400 + n, sb.buf + 8192 + n * 1024, 1024, sb.lkey);
        a.process
            .write(sa.buf + 4096 + n * 1024, &pattern(60 + n as u32, 700))
            .unwrap();
        a.send(a0, 500 + n, sa.buf + 4096 + n * 1024, 700, sa.lkey);
        b.process
            .write(sb.buf + 4096 + n * 1024, &pattern(80 + n as u32, 300))
            .unwrap();
        b.send(b0, 600 + n, sb.buf + 4096 + n * 1024, 300, sb.lkey);
    }
    // QP 1 was never reset: it goes on where it was.
    b.recv(b1, 700, sb.buf + 12288, 1024, sb.lkey);
    a.process.write(sa.buf + 6144, &pattern(90, 800)).unwrap();
    a.send(a1, 701, sa.buf + 6144, 800, sa.lkey);
    w.settle();
    let mut after = a.poll(sa.cq);
    after.sort_unstable_by_key(|c| c.0);
    assert_eq!(
        after,
        [
            (300, WcStatus::Success, 300),
            (301, WcStatus::Success, 300),
            (500, WcStatus::Success, 700),
            (501, WcStatus::Success, 700),
            (701, WcStatus::Success, 800),
        ]
    );
    let mut b_after = b.poll(sb.cq);
    b_after.sort_unstable_by_key(|c| c.0);
    assert_eq!(
        b_after,
        [
            (400, WcStatus::Success, 700),
            (401, WcStatus::Success, 700),
            (600, WcStatus::Success, 300),
            (601, WcStatus::Success, 300),
            (700, WcStatus::Success, 800),
        ]
    );
    for n in 0..2u64 {
        assert_eq!(
            b.read(sb.buf + 8192 + n * 1024, 700),
            pattern(60 + n as u32, 700)
        );
        assert_eq!(
            a.read(sa.buf + 12288 + n * 1024, 300),
            pattern(80 + n as u32, 300)
        );
    }
    assert_eq!(b.read(sb.buf + 12288, 800), pattern(90, 800));

    // Drained (RTS -> SQD -> RTS), QP 1 goes on where it stopped.
    a.modify(
        a1,
        &[
            QpModify::to_state(QpState::Sqd),
            QpModify::to_state(QpState::Rts),
        ],
    );
    b.recv(b1, 800, sb.buf + 13312, 1024, sb.lkey);
    a.process.write(sa.buf + 7168, &pattern(95, 900)).unwrap();
    a.send(a1, 801, sa.buf + 7168, 900, sa.lkey);
    w.settle();
    assert_eq!(a.poll(sa.cq), [(801, WcStatus::Success, 900)]);
    assert_eq!(b.poll(sb.cq), [(800, WcStatus::Success, 900)]);
    assert_eq!(b.read(sb.buf + 13312, 900), pattern(95, 900));
    teardown(a, sa);
    teardown(b, sb);
    w.finish();
}

/// The provider's `CreateQp` pre checks the CQs the QP names itself (any
/// library may call it): a handle it never created, or a CQ of another of
/// its contexts, is refused with `InvalidCqHandle` before any allocation
/// or request.
#[test]
fn a_qp_naming_cqs_the_provider_does_not_know_is_refused_before_anything_is_allocated() {
    let (w, [a_hca, _]) = kernel_pair::two_two_port_hcas(32, GUIDS, &IPS);
    let user = User::new(&w, a_hca, 73);
    let ca = user.ok::<OpenCa>(0, &OpenCaIn::CURRENT).0;
    let other_ca = user.ok::<OpenCa>(0, &OpenCaIn::CURRENT).0;
    let pd = user.ok::<AllocPd>(ca, &Empty).0;
    let attr = CqAttr {
        cqe: 8,
        comp_vector: 0,
    };
    let cq = user.ok::<CreateCq>(ca, &attr).0;
    let other_cq = user.ok::<CreateCq>(other_ca, &attr).0;
    let (requests, allocations, held) = (
        user.process.requests_issued(),
        user.process.space().allocation_count(),
        user.uvp.allocations(),
    );
    let unknown = cq ^ 0x5a5a_0000;
    for (send, recv) in [(unknown, cq), (cq, unknown), (other_cq, cq), (cq, other_cq)] {
        let create = QpCreate {
            send_cq: CqHandle::from_raw(send),
            recv_cq: CqHandle::from_raw(recv),
            ..rc_create(pd, cq)
        };
        assert_eq!(
            user.call::<CreateQp>(ca, &create).err(),
            Some(IbStatus::InvalidCqHandle),
            "send CQ {send:#x}, receive CQ {recv:#x}"
        );
    }
    assert_eq!(user.process.requests_issued(), requests, "no IOCTL");
    assert_eq!(user.process.space().allocation_count(), allocations);
    assert_eq!(user.uvp.allocations(), held);
    // The QP naming its own context's CQ is created as usual.
    let (qp, _) = user.rc_qp(ca, pd, cq);
    user.ok::<DestroyQp>(qp, &Empty);
    user.ok::<DestroyCq>(cq, &Empty);
    user.ok::<DestroyCq>(other_cq, &Empty);
    user.ok::<DeallocPd>(pd, &Empty);
    user.ok::<CloseCa>(other_ca, &Empty);
    user.ok::<CloseCa>(ca, &Empty);
    assert_eq!(user.uvp.allocations(), 0);
    assert_eq!(user.process.exit(), 0);
    w.finish();
}
