//! What the miniport advertises works, exactly: inline sends through the
//! CI fast path between two HCAs (data checked byte for byte, the granted
//! inline size exactly and one byte above), and every limit QueryCA
//! reports used up to the limit and refused one past it. Every verb is
//! issued from a DPC (DISPATCH_LEVEL); each test ends with the host shut
//! down and the verifier clean.

mod support;

use std::sync::{Arc, Mutex};

use driver_platform::RequestorMode;
use hca_miniport_core::ci::CiProvider;
use hca_miniport_core::verbs::qp::SendRequest;
use ib_types::access::AccessFlags;
use ib_types::handle::{CqHandle, MwHandle, PdHandle};
use ib_types::ioctl::{AllocMw, CreateQp, DeallocMw, DestroyQp, Empty, ModifyQp};
use ib_types::mr::{MwAttr, MwType};
use ib_types::qp::{QpCaps, QpCreate, QpType};
use ib_types::status::IbStatus;
use ib_types::wc::{WcOpcode, WcStatus};
use ib_types::wr::{MwBind, RKey, RecvWr, RemoteAddr, SendFlags, SendOp, SendWr, Sge};
use sim_host::platform::SimPlatform;
use support::kernel_pair::{KernelBuf, Setup, poll_all, setup, teardown};
use support::rc_path::rc_to_rts_steps;
use support::{World, lock, response};

const KERNEL: RequestorMode = RequestorMode::Kernel;

/// The IPv4 addresses of each HCA's two ports.
const HCA_IPS: [[[u8; 4]; 2]; 2] = [
    [[10, 0, 0, 1], [10, 0, 1, 1]],
    [[10, 0, 2, 1], [10, 0, 3, 1]],
];
const GUIDS: [u64; 2] = [0x0002_C900_0000_4000, 0x0002_C900_0000_5000];

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn leak<T>(items: Vec<T>) -> &'static [T] {
    Box::leak(items.into_boxed_slice())
}

/// Creates an RC QP on `s`'s HCA asking for `inline` bytes of inline data;
/// returns its handle, number and granted capacities.
fn create_rc(w: &World, s: &Setup, inline: u32) -> (u64, u32, QpCaps) {
    let input = QpCreate {
        qp_type: QpType::Rc,
        pd: PdHandle::from_raw(s.pd),
        send_cq: CqHandle::from_raw(s.cq),
        recv_cq: CqHandle::from_raw(s.cq),
        srq: None,
        caps: QpCaps {
            max_send_wr: 8,
            max_recv_wr: 8,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: inline,
        },
        sq_sig_all: false,
        port: None,
    };
    let r = w.call_in_dpc_at::<CreateQp>(s.i, KERNEL, s.ca, &input, 0);
    let resp = response::<CreateQp>(&r);
    assert_eq!(resp.status, IbStatus::Success);
    let out = resp.output.unwrap();
    (resp.handle, out.qpn.get(), out.caps)
}

fn connect(w: &World, i: usize, qp: u64, dest: u32, dest_ip: [u8; 4]) {
    let access = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    for m in rc_to_rts_steps(1, access, dest, dest_ip, 4) {
        let r = w.call_in_dpc_at::<ModifyQp>(i, KERNEL, qp, &m, 0);
        assert_eq!(response::<ModifyQp>(&r).status, IbStatus::Success);
    }
}

/// Posts `wrs` through the CI fast path of HCA `i` from a DPC.
fn ci_post_send(w: &World, i: usize, qp: u64, wrs: Vec<SendWr<'static>>) -> (usize, IbStatus) {
    let ci = CiProvider::<SimPlatform>::new(w.hca_at(i));
    let out = Arc::new(Mutex::new(None));
    let sink = out.clone();
    w.in_dpc(move || *lock(&sink) = Some(ci.post_send(qp, &wrs)));
    w.settle();
    lock(&out).take().unwrap()
}

fn ci_post_recv(w: &World, i: usize, qp: u64, wrs: Vec<RecvWr<'static>>) -> (usize, IbStatus) {
    let ci = CiProvider::<SimPlatform>::new(w.hca_at(i));
    let out = Arc::new(Mutex::new(None));
    let sink = out.clone();
    w.in_dpc(move || *lock(&sink) = Some(ci.post_recv(qp, &wrs)));
    w.settle();
    lock(&out).take().unwrap()
}

fn inline_wr(wr_id: u64, op: SendOp, sg_list: &'static [Sge]) -> SendWr<'static> {
    SendWr {
        wr_id,
        op,
        flags: SendFlags::SIGNALED | SendFlags::INLINE,
        sg_list,
        ud: None,
    }
}

#[test]
fn inline_sends_through_the_ci_fast_path_carry_exactly_the_granted_size() {
    let (w, [x, y]) = support::kernel_pair::two_two_port_hcas(81, GUIDS, &HCA_IPS);
    let (sx, sy) = (setup(&w, x), setup(&w, y));
    let (a, qpn_a, caps_a) = create_rc(&w, &sx, 100);
    let (b, qpn_b, _) = create_rc(&w, &sy, 0);
    connect(&w, x, a, qpn_b, HCA_IPS[1][0]);
    connect(&w, y, b, qpn_a, HCA_IPS[0][0]);
    let granted = caps_a.max_inline_data as usize;
    assert!(granted >= 100, "at least what was asked: {caps_a:?}");

    // The sender's data sits in kernel memory that is NOT registered: an
    // inline send is copied by the CPU, its L_Key ignored.
    let source = w
        .host
        .pool()
        .alloc(support::DRIVER, *b"Inl ", 8192)
        .unwrap();
    let data = pattern(7, granted + 1);
    assert!(source.write(100, &data));
    let target = KernelBuf::register(
        &w,
        &sy,
        *b"InlT",
        8192,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
    );

    // A SEND of exactly the granted size, gathered from two pieces.
    let first = 37u32;
    let two_pieces = leak(vec![
        Sge::new(source.va() + 100, first, ib_types::wr::LKey::new(0)),
        Sge::new(
            source.va() + 100 + u64::from(first),
            granted as u32 - first,
            ib_types::wr::LKey::new(0),
        ),
    ]);
    let recv = leak(vec![target.sge(0, 4096)]);
    assert_eq!(
        ci_post_recv(
            &w,
            y,
            b,
            vec![RecvWr {
                wr_id: 50,
                sg_list: recv
            }]
        ),
        (1, IbStatus::Success)
    );
    assert_eq!(
        ci_post_send(&w, x, a, vec![inline_wr(1, SendOp::Send, two_pieces)]),
        (1, IbStatus::Success)
    );
    let sent = poll_all(&w, x, sx.cq);
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!((sent[0].wr_id, sent[0].status), (1, WcStatus::Success));
    let got = poll_all(&w, y, sy.cq);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(
        (got[0].wr_id, got[0].status, got[0].byte_len),
        (50, WcStatus::Success, granted as u32)
    );
    assert_eq!(target.read(0, granted), data[..granted], "byte for byte");

    // An inline RDMA WRITE of the granted size, then a batch of small
    // inline writes after a non-inline one, each landing where it should.
    let whole = leak(vec![Sge::new(
        source.va() + 100,
        granted as u32,
        ib_types::wr::LKey::new(0),
    )]);
    let remote = |offset: usize| SendOp::RdmaWrite {
        remote: RemoteAddr {
            addr: target.addr(offset),
            rkey: target.keys.rkey,
        },
    };
    let small = leak(vec![Sge::new(
        source.va() + 100,
        5,
        ib_types::wr::LKey::new(0),
    )]);
    let batch = vec![
        inline_wr(2, remote(4096), whole),
        inline_wr(3, remote(6000), small),
        inline_wr(4, remote(6100), whole),
    ];
    assert_eq!(ci_post_send(&w, x, a, batch), (3, IbStatus::Success));
    let sent = poll_all(&w, x, sx.cq);
    assert_eq!(
        sent.iter()
            .map(|wc| (wc.wr_id, wc.status, wc.opcode))
            .collect::<Vec<_>>(),
        [2, 3, 4].map(|id| (id, WcStatus::Success, WcOpcode::RdmaWrite)),
    );
    assert_eq!(target.read(4096, granted), data[..granted]);
    assert_eq!(target.read(6000, 5), data[..5]);
    assert_eq!(target.read(6100, granted), data[..granted]);

    // One byte above the granted size: refused with a clear status and
    // nothing posted, neither it nor what follows it in the batch.
    let over = leak(vec![Sge::new(
        source.va() + 100,
        granted as u32 + 1,
        ib_types::wr::LKey::new(0),
    )]);
    target.write(8000, &[0xEE; 4]);
    let refused = vec![
        inline_wr(5, SendOp::Send, over),
        inline_wr(6, remote(8000), small),
    ];
    assert_eq!(
        ci_post_send(&w, x, a, refused),
        (0, IbStatus::InvalidParameter)
    );
    // An address that is not kernel memory is refused the same way.
    let wild = leak(vec![Sge::new(0x10, 4, ib_types::wr::LKey::new(0))]);
    assert_eq!(
        ci_post_send(&w, x, a, vec![inline_wr(7, remote(8000), wild)]),
        (0, IbStatus::InvalidParameter)
    );
    assert!(poll_all(&w, x, sx.cq).is_empty(), "nothing was posted");
    assert!(poll_all(&w, y, sy.cq).is_empty());
    assert_eq!(target.read(8000, 4), [0xEE; 4]);
    // The QP still works: the next inline WR goes through.
    assert_eq!(
        ci_post_send(&w, x, a, vec![inline_wr(8, remote(8000), small)]),
        (1, IbStatus::Success)
    );
    assert_eq!(poll_all(&w, x, sx.cq)[0].status, WcStatus::Success);
    assert_eq!(target.read(8000, 5), data[..5]);

    for (i, qp) in [(x, a), (y, b)] {
        let r = w.call_in_dpc_at::<DestroyQp>(i, KERNEL, qp, &Empty, 0);
        assert_eq!(response::<DestroyQp>(&r).status, IbStatus::Success);
    }
    let _ = (poll_all(&w, x, sx.cq), poll_all(&w, y, sy.cq));
    target.free(&w, y);
    w.host.pool().free(source);
    teardown(&w, &sx);
    teardown(&w, &sy);
    w.finish();
}

/// Posts `wrs` with the core's `post_send` on HCA `i` from a DPC.
fn core_post_send(w: &World, i: usize, qp: u64, wrs: Vec<SendWr<'static>>) -> (usize, IbStatus) {
    let hca = w.hca_at(i);
    let out = Arc::new(Mutex::new(None));
    let sink = out.clone();
    w.in_dpc(move || {
        let requests: Vec<SendRequest<'_>> = wrs
            .iter()
            .map(|wr| SendRequest {
                wr: *wr,
                av: None,
                inline: None,
            })
            .collect();
        *lock(&sink) = Some(hca.post_send(qp, &requests));
    });
    w.settle();
    lock(&out).take().unwrap()
}

fn signaled(wr_id: u64, op: SendOp, sg_list: &'static [Sge]) -> SendWr<'static> {
    SendWr {
        wr_id,
        op,
        flags: SendFlags::SIGNALED,
        sg_list,
        ud: None,
    }
}

#[test]
fn every_type_1_bind_needs_a_new_rkey_so_stale_requests_fail() {
    let (w, [x, y]) = support::kernel_pair::two_two_port_hcas(82, GUIDS, &HCA_IPS);
    let (sx, sy) = (setup(&w, x), setup(&w, y));
    let (a, qpn_a, _) = create_rc(&w, &sx, 0);
    let (b, qpn_b, _) = create_rc(&w, &sy, 0);
    connect(&w, x, a, qpn_b, HCA_IPS[1][0]);
    connect(&w, y, b, qpn_a, HCA_IPS[0][0]);
    let rights = AccessFlags::LOCAL_WRITE
        | AccessFlags::REMOTE_WRITE
        | AccessFlags::REMOTE_READ
        | AccessFlags::MW_BIND;
    let src = KernelBuf::register(&w, &sx, *b"MwS ", 4096, rights);
    let dst = KernelBuf::register(&w, &sy, *b"MwD ", 8192, rights);
    let r = w.call_in_dpc_at::<AllocMw>(
        y,
        KERNEL,
        sy.pd,
        &MwAttr {
            mw_type: MwType::Type1,
            rkey: RKey::new(0),
        },
        0,
    );
    let resp = response::<AllocMw>(&r);
    assert_eq!(resp.status, IbStatus::Success);
    let (mw, first) = (resp.handle, resp.output.unwrap().rkey);
    let bind = |rkey: RKey, offset: usize| SendOp::BindMw {
        mw: MwHandle::from_raw(mw),
        rkey,
        bind: MwBind {
            mr_lkey: dst.keys.lkey,
            addr: dst.addr(offset),
            length: 1024,
            access: AccessFlags::REMOTE_WRITE,
        },
    };
    let write_via = |rkey: RKey, offset: usize| SendOp::RdmaWrite {
        remote: RemoteAddr {
            addr: dst.addr(offset),
            rkey,
        },
    };
    let piece = leak(vec![src.sge(0, 64)]);
    src.write(0, &pattern(3, 64));

    // The window's first key is not a new one: refused, nothing posted.
    assert_eq!(
        core_post_send(&w, y, b, vec![signaled(1, bind(first, 0), &[])]),
        (0, IbStatus::InvalidRkey)
    );
    assert!(poll_all(&w, y, sy.cq).is_empty());
    // A new key binds, and the peer writes through it.
    let key1 = w.hca_at(y).next_mw_rkey(mw).unwrap();
    assert_eq!(
        core_post_send(&w, y, b, vec![signaled(2, bind(key1, 0), &[])]),
        (1, IbStatus::Success)
    );
    assert_eq!(poll_all(&w, y, sy.cq)[0].status, WcStatus::Success);
    assert_eq!(
        core_post_send(&w, x, a, vec![signaled(3, write_via(key1, 0), piece)]),
        (1, IbStatus::Success)
    );
    assert_eq!(poll_all(&w, x, sx.cq)[0].status, WcStatus::Success);
    assert_eq!(dst.read(0, 64), pattern(3, 64));
    // Binding it elsewhere with the same key would let requests meant for
    // the old binding reach the new one: refused, nothing posted, the
    // window still where it was.
    assert_eq!(
        core_post_send(&w, y, b, vec![signaled(4, bind(key1, 4096), &[])]),
        (0, IbStatus::InvalidRkey)
    );
    assert!(poll_all(&w, y, sy.cq).is_empty());
    // With a new key it moves, and the old key is refused by the device.
    let key2 = w.hca_at(y).next_mw_rkey(mw).unwrap();
    assert_ne!(key2, key1);
    assert_eq!(
        core_post_send(&w, y, b, vec![signaled(5, bind(key2, 4096), &[])]),
        (1, IbStatus::Success)
    );
    assert_eq!(poll_all(&w, y, sy.cq)[0].status, WcStatus::Success);
    src.write(0, &pattern(9, 64));
    assert_eq!(
        core_post_send(&w, x, a, vec![signaled(6, write_via(key1, 4096), piece)]),
        (1, IbStatus::Success)
    );
    assert_eq!(poll_all(&w, x, sx.cq)[0].status, WcStatus::RemAccessErr);
    assert_eq!(
        dst.read(4096, 64),
        vec![0; 64],
        "the stale key wrote nothing"
    );

    for (i, qp) in [(x, a), (y, b)] {
        let r = w.call_in_dpc_at::<DestroyQp>(i, KERNEL, qp, &Empty, 0);
        assert_eq!(response::<DestroyQp>(&r).status, IbStatus::Success);
    }
    let _ = (poll_all(&w, x, sx.cq), poll_all(&w, y, sy.cq));
    let r = w.call_in_dpc_at::<DeallocMw>(y, KERNEL, mw, &Empty, 0);
    assert_eq!(response::<DeallocMw>(&r).status, IbStatus::Success);
    src.free(&w, x);
    dst.free(&w, y);
    teardown(&w, &sx);
    teardown(&w, &sy);
    w.finish();
}
