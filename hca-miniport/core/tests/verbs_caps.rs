//! What the miniport advertises works, exactly: inline sends through the
//! CI fast path between two HCAs (data checked byte for byte, the granted
//! inline size exactly and one byte above), and every limit QueryCA
//! reports used up to the limit and refused one past it. Every verb is
//! issued from a DPC (DISPATCH_LEVEL); each test ends with the host shut
//! down and the verifier clean.

mod support;

use std::sync::{Arc, Mutex};

use driver_platform::RequestorMode;
use hca_miniport_core::verbs::qp::SendRequest;
use ib_types::access::AccessFlags;
use ib_types::handle::{CqHandle, MwHandle, PdHandle};
use ib_types::ioctl::{AllocMw, CreateQp, DeallocMw, DestroyQp, Empty, ModifyQp};
use ib_types::mr::{MwAttr, MwType};
use ib_types::qp::{QpCaps, QpCreate, QpType};
use ib_types::status::IbStatus;
use ib_types::wc::{WcOpcode, WcStatus};
use ib_types::wr::{MwBind, RKey, RecvWr, RemoteAddr, SendFlags, SendOp, SendWr, Sge};
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
    let ci = w.device_at(i).provider().expect("the CI provider");
    let out = Arc::new(Mutex::new(None));
    let sink = out.clone();
    w.in_dpc(move || *lock(&sink) = Some(ci.post_send(qp, &wrs)));
    w.settle();
    lock(&out).take().unwrap()
}

fn ci_post_recv(w: &World, i: usize, qp: u64, wrs: Vec<RecvWr<'static>>) -> (usize, IbStatus) {
    let ci = w.device_at(i).provider().expect("the CI provider");
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
    // A wild address behind a good WR (the core gathers each WR's bytes
    // under the ring lock, after its checks): the good one is posted and
    // lands, the wild one is refused and nothing of it is posted.
    target.write(7100, &[0xEE; 4]);
    assert_eq!(
        ci_post_send(
            &w,
            x,
            a,
            vec![
                inline_wr(9, remote(7000), small),
                inline_wr(10, remote(7100), wild),
            ]
        ),
        (1, IbStatus::InvalidParameter)
    );
    let sent = poll_all(&w, x, sx.cq);
    assert_eq!(
        sent.iter()
            .map(|wc| (wc.wr_id, wc.status))
            .collect::<Vec<_>>(),
        [(9, WcStatus::Success)]
    );
    assert_eq!(target.read(7000, 5), data[..5]);
    assert_eq!(target.read(7100, 4), [0xEE; 4]);

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

/// A kernel client's inline WR that the WR checks refuse reports their
/// error even when its bytes cannot be read: the core gathers the bytes
/// before the specialised encoder's checks (round 6 of issue 13), and a
/// failed gather must not hide why the WR itself is wrong (too many SGEs,
/// INLINE on an RDMA READ). Nothing is posted.
#[test]
fn a_refused_inline_wr_with_an_unreadable_address_reports_the_wrs_error() {
    let (w, [x, y]) = support::kernel_pair::two_two_port_hcas(86, GUIDS, &HCA_IPS);
    let (sx, sy) = (setup(&w, x), setup(&w, y));
    let (a, qpn_a, caps_a) = create_rc(&w, &sx, 64);
    let (b, qpn_b, _) = create_rc(&w, &sy, 0);
    connect(&w, x, a, qpn_b, HCA_IPS[1][0]);
    connect(&w, y, b, qpn_a, HCA_IPS[0][0]);
    // Not kernel memory: a gather of it fails.
    let wild = Sge::new(0x10, 4, ib_types::wr::LKey::new(0));
    let too_many = leak(vec![wild; caps_a.max_send_sge as usize + 1]);
    assert_eq!(
        ci_post_send(&w, x, a, vec![inline_wr(1, SendOp::Send, too_many)]),
        (0, IbStatus::InvalidMaxSge)
    );
    let read = SendOp::RdmaRead {
        remote: RemoteAddr {
            addr: 0x1000,
            rkey: RKey::new(1),
        },
    };
    assert_eq!(
        ci_post_send(&w, x, a, vec![inline_wr(2, read, leak(vec![wild]))]),
        (0, IbStatus::InvalidSetting)
    );
    // A WR the checks accept: the gather's own refusal.
    assert_eq!(
        ci_post_send(&w, x, a, vec![inline_wr(3, SendOp::Send, leak(vec![wild]))]),
        (0, IbStatus::InvalidParameter)
    );
    assert!(poll_all(&w, x, sx.cq).is_empty(), "nothing was posted");
    for (i, qp) in [(x, a), (y, b)] {
        let r = w.call_in_dpc_at::<DestroyQp>(i, KERNEL, qp, &Empty, 0);
        assert_eq!(response::<DestroyQp>(&r).status, IbStatus::Success);
    }
    let _ = (poll_all(&w, x, sx.cq), poll_all(&w, y, sy.cq));
    teardown(&w, &sx);
    teardown(&w, &sy);
    w.finish();
}

/// A kernel client's inline send reads its bytes through the kernel
/// memory access the shell installs at start (`Hca::set_kernel_locker`),
/// which each QP captures when it is created (no lock taken per post): a
/// QP created before the access is installed again keeps reading through
/// the one it captured, a QP created after through the new one.
#[test]
fn an_inline_send_reads_through_the_kernel_locker_its_qp_captured() {
    let (w, [x, y]) = support::kernel_pair::two_two_port_hcas(85, GUIDS, &HCA_IPS);
    let (sx, sy) = (setup(&w, x), setup(&w, y));
    let source = w
        .host
        .pool()
        .alloc(support::DRIVER, *b"Inl ", 4096)
        .unwrap();
    let data = pattern(9, 64);
    assert!(source.write(0, &data));
    let target = KernelBuf::register(
        &w,
        &sy,
        *b"InlT",
        8192,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
    );
    let sge = leak(vec![Sge::new(source.va(), 64, ib_types::wr::LKey::new(0))]);
    let write_at = |offset: usize| SendOp::RdmaWrite {
        remote: RemoteAddr {
            addr: target.addr(offset),
            rkey: target.keys.rkey,
        },
    };

    let (early, qpn_early, _) = create_rc(&w, &sx, 64);
    let (early_peer, qpn_early_peer, _) = create_rc(&w, &sy, 0);
    connect(&w, x, early, qpn_early_peer, HCA_IPS[1][0]);
    connect(&w, y, early_peer, qpn_early, HCA_IPS[0][0]);
    // The access installed again: the QP created before still reads
    // through the one it captured.
    w.install_kernel_locker(x);
    assert_eq!(
        ci_post_send(&w, x, early, vec![inline_wr(2, write_at(0), sge)]),
        (1, IbStatus::Success)
    );
    let sent = poll_all(&w, x, sx.cq);
    assert_eq!(
        sent.iter()
            .map(|wc| (wc.wr_id, wc.status))
            .collect::<Vec<_>>(),
        [(2, WcStatus::Success)]
    );
    assert_eq!(target.read(0, 64), data);

    // A QP created after reads through the new one.
    let (late, qpn_late, _) = create_rc(&w, &sx, 64);
    let (late_peer, qpn_late_peer, _) = create_rc(&w, &sy, 0);
    connect(&w, x, late, qpn_late_peer, HCA_IPS[1][0]);
    connect(&w, y, late_peer, qpn_late, HCA_IPS[0][0]);
    assert_eq!(
        ci_post_send(&w, x, late, vec![inline_wr(3, write_at(4096), sge)]),
        (1, IbStatus::Success)
    );
    let sent = poll_all(&w, x, sx.cq);
    assert_eq!(
        sent.iter()
            .map(|wc| (wc.wr_id, wc.status))
            .collect::<Vec<_>>(),
        [(3, WcStatus::Success)]
    );
    assert_eq!(target.read(4096, 64), data);

    for (i, qp) in [(x, early), (y, early_peer), (x, late), (y, late_peer)] {
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

/// A post of one WR through the CI while the QP's destroy is under way
/// (submitted in the same DPC, before the post) is refused with
/// `InvalidQpHandle` and reaches neither the ring nor the CQ; once the
/// destroy completed, the handle is stale and refused the same way.
#[test]
fn a_one_wr_post_during_and_after_its_qps_destroy_is_refused() {
    let (w, [x, y]) = support::kernel_pair::two_two_port_hcas(86, GUIDS, &HCA_IPS);
    let (sx, sy) = (setup(&w, x), setup(&w, y));
    let source = w
        .host
        .pool()
        .alloc(support::DRIVER, *b"Inl ", 4096)
        .unwrap();
    assert!(source.write(0, &pattern(4, 16)));
    let sge = leak(vec![Sge::new(source.va(), 16, ib_types::wr::LKey::new(0))]);
    let (a, qpn_a, _) = create_rc(&w, &sx, 64);
    let (b, qpn_b, _) = create_rc(&w, &sy, 0);
    connect(&w, x, a, qpn_b, HCA_IPS[1][0]);
    connect(&w, y, b, qpn_a, HCA_IPS[0][0]);
    let ci = w.device_at(x).provider().expect("the CI provider");
    let posted = Arc::new(Mutex::new(None));
    let (request, issuer) = w.request::<DestroyQp>(KERNEL, a, &Empty, 0);
    {
        let (hca, posted) = (w.hca_at(x), posted.clone());
        w.in_dpc(move || {
            hca.submit_request(request);
            *lock(&posted) = Some(ci.post_send(a, &[inline_wr(1, SendOp::Send, sge)]));
        });
    }
    w.settle();
    assert_eq!(*lock(&posted), Some((0, IbStatus::InvalidQpHandle)));
    let done = issuer.completion().unwrap();
    assert_eq!(response::<DestroyQp>(&done).status, IbStatus::Success);
    assert!(poll_all(&w, x, sx.cq).is_empty(), "nothing was posted");
    assert_eq!(
        ci_post_send(&w, x, a, vec![inline_wr(2, SendOp::Send, sge)]),
        (0, IbStatus::InvalidQpHandle)
    );
    let r = w.call_in_dpc_at::<DestroyQp>(y, KERNEL, b, &Empty, 0);
    assert_eq!(response::<DestroyQp>(&r).status, IbStatus::Success);
    let _ = poll_all(&w, y, sy.cq);
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
    // The same through the CI's one-WR path (which hands a bind to the
    // batch path, its window resolved before the ring lock).
    assert_eq!(
        ci_post_send(&w, y, b, vec![signaled(4, bind(key1, 4096), &[])]),
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

/// Submits one request of `V` per `(handle, input)` from one DPC, runs the
/// machine, and returns each response's status and handle, in order.
fn batch<V: ib_types::ioctl::Verb>(w: &World, inputs: &[(u64, V::In)]) -> Vec<(IbStatus, u64)> {
    let (requests, issuers): (Vec<_>, Vec<_>) = inputs
        .iter()
        .map(|(handle, input)| w.request::<V>(KERNEL, *handle, input, 0))
        .unzip();
    let hca = w.hca();
    w.in_dpc(move || {
        for request in requests {
            hca.submit_request(request);
        }
    });
    w.settle();
    issuers
        .iter()
        .map(|issuer| {
            let completion = issuer.completion().expect("completed");
            let r = response::<V>(&completion);
            (r.status, r.handle)
        })
        .collect()
}

/// `n` creations that must all succeed; returns the handles.
#[track_caller]
fn create_all<V: ib_types::ioctl::Verb>(
    w: &World,
    inputs: &[(u64, V::In)],
    what: &str,
) -> Vec<u64> {
    let out = batch::<V>(w, inputs);
    for (i, (status, _)) in out.iter().enumerate() {
        assert_eq!(
            *status,
            IbStatus::Success,
            "{what} #{i} of {}",
            inputs.len()
        );
    }
    out.into_iter().map(|(_, h)| h).collect()
}

/// One creation; returns its status and handle.
fn create_one<V: ib_types::ioctl::Verb>(w: &World, handle: u64, input: V::In) -> (IbStatus, u64) {
    batch::<V>(w, &[(handle, input)])[0]
}

/// Destroys every handle with `V`, each of which must succeed.
#[track_caller]
fn destroy_all<V: ib_types::ioctl::Verb<In = Empty>>(w: &World, handles: &[u64]) {
    let inputs: Vec<(u64, Empty)> = handles.iter().map(|&h| (h, Empty)).collect();
    for (status, _) in batch::<V>(w, &inputs) {
        assert_eq!(status, IbStatus::Success);
    }
}

/// A small device, so every table can be filled quickly.
fn small_device() -> sim_hca::device::DeviceConfig {
    let mut d = sim_hca::device::DeviceConfig::with_ports(GUIDS[0], &HCA_IPS[0]);
    let l = &mut d.limits;
    l.log_max_qps = 5;
    l.log_max_cqs = 4;
    l.log_max_srqs = 2;
    l.log_max_mpts = 5;
    l.log_max_wqes = 8;
    l.log_max_cqes = 8;
    l.log_max_srq_wqes = 7;
    l.max_send_sges = 4;
    l.max_recv_sges = 4;
    l.max_rd_atomic = 4;
    l.max_inline_bytes = 64;
    l.max_mcast_groups = 3;
    l.max_qps_per_mcast_group = 3;
    d
}

fn qp_input(
    pd: u64,
    send_cq: u64,
    recv_cq: u64,
    qp_type: QpType,
    caps: QpCaps,
    port: Option<u8>,
) -> QpCreate {
    QpCreate {
        qp_type,
        pd: PdHandle::from_raw(pd),
        send_cq: CqHandle::from_raw(send_cq),
        recv_cq: CqHandle::from_raw(recv_cq),
        srq: None,
        caps,
        sq_sig_all: false,
        port: port.map(|p| ib_types::scalars::PortNum::new(p).unwrap()),
    }
}

const ONE_WR: QpCaps = QpCaps {
    max_send_wr: 1,
    max_recv_wr: 1,
    max_send_sge: 1,
    max_recv_sge: 1,
    max_inline_data: 0,
};

#[test]
fn every_limit_query_ca_reports_is_exactly_what_works() {
    use ib_types::ioctl::{
        AllocPd, AttachMcast, CreateAv, CreateCq, CreateSrq, DeallocPd, DeregMr, DestroyAv,
        DestroyCq, DestroySrq, DetachMcast, OpenCa, OpenCaIn, QueryCa, RegMr, RegPhysMr,
    };
    let w = World::with_hcas(
        83,
        vec![small_device()],
        hca_miniport_core::init::HcaConfig::default(),
    );
    w.install_kernel_locker(0);
    let r = w.call_in_dpc::<OpenCa>(KERNEL, 0, &OpenCaIn::CURRENT, 0);
    let ca = response::<OpenCa>(&r).handle;
    let r = w.call_in_dpc::<QueryCa>(KERNEL, ca, &Empty, 16);
    let needed = response::<QueryCa>(&r).output.unwrap().total_size;
    let r = w.call_in_dpc::<QueryCa>(KERNEL, ca, &Empty, needed);
    let l = ib_types::ca::CaAttrView::parse(response::<QueryCa>(&r).private)
        .unwrap()
        .attr()
        .limits;
    // The small device's tables (a sanity check that this is the device
    // configured above, not the limits under test).
    assert_eq!((l.max_qps, l.max_cqs, l.max_srqs), (32, 16, 4));

    // Protection domains: the limit, then one more.
    let pds = create_all::<AllocPd>(&w, &vec![(ca, Empty); l.max_pds as usize], "PD");
    assert_ne!(
        create_one::<AllocPd>(&w, ca, Empty).0,
        IbStatus::Success,
        "PD past the limit"
    );
    destroy_all::<DeallocPd>(&w, &pds[1..]);
    let pd = pds[0];

    // Address vectors.
    let av = support::rc_path::grh_av(1, HCA_IPS[0][1]);
    let avs = create_all::<CreateAv>(&w, &vec![(pd, av); l.max_avs as usize], "AV");
    assert_ne!(
        create_one::<CreateAv>(&w, pd, av).0,
        IbStatus::Success,
        "AV past the limit"
    );
    destroy_all::<DestroyAv>(&w, &avs);

    // CQ entries, then CQs.
    let cq_of = |cqe| ib_types::cq::CqAttr {
        cqe,
        comp_vector: 0,
    };
    let (status, big_cq) = create_one::<CreateCq>(&w, ca, cq_of(l.max_cqes));
    assert_eq!(status, IbStatus::Success, "a CQ of max_cqes entries");
    assert_eq!(
        create_one::<CreateCq>(&w, ca, cq_of(l.max_cqes + 1)).0,
        IbStatus::InvalidCqSize
    );
    let (status, big_cq2) = create_one::<CreateCq>(&w, ca, cq_of(l.max_cqes));
    assert_eq!(status, IbStatus::Success);
    let mut cqs = vec![big_cq, big_cq2];
    cqs.extend(create_all::<CreateCq>(
        &w,
        &vec![(ca, cq_of(1)); l.max_cqs as usize - 2],
        "CQ",
    ));
    assert_ne!(
        create_one::<CreateCq>(&w, ca, cq_of(1)).0,
        IbStatus::Success,
        "CQ past the limit"
    );
    destroy_all::<DestroyCq>(&w, &cqs[2..]);
    let (cq, cq2) = (cqs[0], cqs[1]);

    // QPs: every port's two special QPs and general UD QPs up to the limit.
    let mut qps = Vec::new();
    for port in 1..=2u8 {
        for qp_type in [QpType::Smi, QpType::Gsi] {
            let input = qp_input(pd, cq, cq, qp_type, ONE_WR, Some(port));
            let (status, qp) = create_one::<CreateQp>(&w, ca, input);
            assert_eq!(status, IbStatus::Success, "{qp_type:?} on port {port}");
            qps.push(qp);
        }
    }
    let ud = qp_input(pd, cq, cq, QpType::Ud, ONE_WR, None);
    let general = create_all::<CreateQp>(&w, &vec![(ca, ud); l.max_qps as usize - qps.len()], "QP");
    assert_ne!(
        create_one::<CreateQp>(&w, ca, ud).0,
        IbStatus::Success,
        "QP past the limit"
    );

    // Multicast: one QP in max_mcast_groups groups, max_qps_per_mcast_group
    // QPs in one group; one more of each is refused.
    let group = |n: u8| ib_types::mcast::McastGroup {
        mgid: ib_types::scalars::Gid::from_ipv4([239, 1, 1, n]),
        mlid: ib_types::scalars::Lid::default(),
    };
    let groups: Vec<_> = (0..l.max_mcast_groups as u8)
        .map(|n| (general[0], group(n)))
        .collect();
    let mut members = create_all::<AttachMcast>(&w, &groups, "group");
    let extra = group(l.max_mcast_groups as u8);
    assert_eq!(
        create_one::<AttachMcast>(&w, general[0], extra).0,
        IbStatus::MaxMcastQpsReached
    );
    let more: Vec<_> = general[1..l.max_qps_per_mcast_group as usize]
        .iter()
        .map(|&qp| (qp, group(0)))
        .collect();
    members.extend(create_all::<AttachMcast>(&w, &more, "member"));
    let next = general[l.max_qps_per_mcast_group as usize];
    assert_eq!(
        create_one::<AttachMcast>(&w, next, group(0)).0,
        IbStatus::MaxMcastQpsReached
    );
    destroy_all::<DetachMcast>(&w, &members);
    qps.extend(general);
    destroy_all::<DestroyQp>(&w, &qps);
    // The numbers are reused only after the quiet period.
    w.host
        .scheduler()
        .advance(hca_miniport_core::verbs::qp::QPN_QUIET_PERIOD_NS)
        .unwrap();

    // Per QP: WRs (one-SGE RC QPs, whose WQEs take one basic block), SGEs,
    // inline data; each exactly, then one more.
    let rc = |caps: QpCaps| qp_input(pd, cq, cq2, QpType::Rc, caps, None);
    let exactly = [
        QpCaps {
            max_send_wr: l.max_wrs_per_qp,
            ..ONE_WR
        },
        QpCaps {
            max_recv_wr: l.max_wrs_per_qp,
            ..ONE_WR
        },
        QpCaps {
            max_send_sge: l.max_sges,
            ..ONE_WR
        },
        QpCaps {
            max_recv_sge: l.max_sges,
            ..ONE_WR
        },
        QpCaps {
            max_inline_data: l.max_inline_data,
            ..ONE_WR
        },
    ];
    for caps in exactly {
        let (status, qp) = create_one::<CreateQp>(&w, ca, rc(caps));
        assert_eq!(status, IbStatus::Success, "{caps:?}");
        destroy_all::<DestroyQp>(&w, &[qp]);
    }
    let one_more = [
        (
            QpCaps {
                max_send_wr: l.max_wrs_per_qp + 1,
                ..ONE_WR
            },
            IbStatus::InvalidMaxWrs,
        ),
        (
            QpCaps {
                max_recv_wr: l.max_wrs_per_qp + 1,
                ..ONE_WR
            },
            IbStatus::InvalidMaxWrs,
        ),
        (
            QpCaps {
                max_send_sge: l.max_sges + 1,
                ..ONE_WR
            },
            IbStatus::InvalidMaxSge,
        ),
        (
            QpCaps {
                max_recv_sge: l.max_sges + 1,
                ..ONE_WR
            },
            IbStatus::InvalidMaxSge,
        ),
        (
            QpCaps {
                max_inline_data: l.max_inline_data + 1,
                ..ONE_WR
            },
            IbStatus::InvalidParameter,
        ),
    ];
    for (caps, refusal) in one_more {
        assert_eq!(
            create_one::<CreateQp>(&w, ca, rc(caps)).0,
            refusal,
            "{caps:?}"
        );
    }

    // Reads and atomics in flight: both depths at the limit take an RC QP
    // to RTS; one more is refused at RTR (responder resources) and at RTS
    // (initiator depth).
    let access = AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC;
    assert_eq!(l.max_qp_rd_atomic, l.max_qp_resp_res);
    let depth = l.max_qp_rd_atomic as u8;
    let modify = |qp: u64, m: &ib_types::qp::QpModify| {
        let r = w.call_in_dpc::<ModifyQp>(KERNEL, qp, m, 0);
        response::<ModifyQp>(&r).status
    };
    let (_, qp) = create_one::<CreateQp>(&w, ca, rc(ONE_WR));
    for m in rc_to_rts_steps(1, access, 2, HCA_IPS[0][1], depth) {
        assert_eq!(modify(qp, &m), IbStatus::Success, "{m:?}");
    }
    let [init, mut rtr, _] = rc_to_rts_steps(1, access, 2, HCA_IPS[0][1], depth);
    rtr.max_dest_rd_atomic = Some(depth + 1);
    let (_, over_resp) = create_one::<CreateQp>(&w, ca, rc(ONE_WR));
    assert_eq!(modify(over_resp, &init), IbStatus::Success);
    assert_ne!(
        modify(over_resp, &rtr),
        IbStatus::Success,
        "responder resources past the limit"
    );
    let [init, rtr, mut rts] = rc_to_rts_steps(1, access, 2, HCA_IPS[0][1], depth);
    rts.max_rd_atomic = Some(depth + 1);
    let (_, over_init) = create_one::<CreateQp>(&w, ca, rc(ONE_WR));
    assert_eq!(modify(over_init, &init), IbStatus::Success);
    assert_eq!(modify(over_init, &rtr), IbStatus::Success);
    assert_ne!(
        modify(over_init, &rts),
        IbStatus::Success,
        "initiator depth past the limit"
    );
    destroy_all::<DestroyQp>(&w, &[qp, over_resp, over_init]);

    // SRQs: depth and SGEs exactly and one more, then the table.
    let srq_of = |max_wr, max_sge| ib_types::srq::SrqCreate {
        pd: PdHandle::from_raw(pd),
        attr: ib_types::srq::SrqAttr {
            max_wr,
            max_sge,
            srq_limit: 0,
        },
    };
    let (status, deep) = create_one::<CreateSrq>(&w, ca, srq_of(l.max_srq_wrs, l.max_srq_sges));
    assert_eq!(status, IbStatus::Success);
    assert_eq!(
        create_one::<CreateSrq>(&w, ca, srq_of(l.max_srq_wrs + 1, 1)).0,
        IbStatus::InvalidSrqSize
    );
    assert_ne!(
        create_one::<CreateSrq>(&w, ca, srq_of(1, l.max_srq_sges + 1)).0,
        IbStatus::Success
    );
    let mut srqs = vec![deep];
    srqs.extend(create_all::<CreateSrq>(
        &w,
        &vec![(ca, srq_of(1, 1)); l.max_srqs as usize - 1],
        "SRQ",
    ));
    assert_ne!(
        create_one::<CreateSrq>(&w, ca, srq_of(1, 1)).0,
        IbStatus::Success,
        "SRQ past the limit"
    );
    destroy_all::<DestroySrq>(&w, &srqs);

    // The largest region: a physical one of exactly max_mr_size in 1 GiB
    // pages (nothing behind them is touched), then one byte more.
    let reg_phys = |length: u64| {
        let gib = 1u64 << 30;
        let num_pages = length.div_ceil(gib) as u32;
        let input = ib_types::mr::PhysMrRegister {
            iova: 0,
            length,
            first_byte_offset: 0,
            page_shift: 30,
            num_pages,
            access: AccessFlags::LOCAL_WRITE,
        };
        let pages: Vec<u8> = (0..u64::from(num_pages))
            .flat_map(|i| (i * gib).to_le_bytes())
            .collect();
        let mut bytes = vec![0; ib_types::ioctl::request_len::<RegPhysMr>(pages.len()).unwrap()];
        ib_types::ioctl::encode_request::<RegPhysMr>(pd, &input, &pages, 0, &mut bytes).unwrap();
        let out_len = ib_types::ioctl::response_len::<RegPhysMr>(0).unwrap();
        let code = <RegPhysMr as ib_types::ioctl::Verb>::ID.ioctl().raw();
        let (request, issuer) = w.raw_request(code, KERNEL, bytes, out_len);
        let r = w.submit_in_dpc_at(0, request, issuer);
        let resp = response::<RegPhysMr>(&r);
        (resp.status, resp.handle)
    };
    let (status, largest) = reg_phys(l.max_mr_size);
    assert_eq!(status, IbStatus::Success, "a region of max_mr_size bytes");
    assert_eq!(reg_phys(l.max_mr_size + 1).0, IbStatus::InvalidParameter);
    destroy_all::<DeregMr>(&w, &[largest]);

    // Regions, then windows (they share the MPT table).
    let block = w
        .host
        .pool()
        .alloc(support::DRIVER, *b"Lim ", 4096)
        .unwrap();
    let region = ib_types::mr::MrRegister {
        vaddr: block.va(),
        length: 4096,
        access: AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND,
    };
    let mrs = create_all::<RegMr>(&w, &vec![(pd, region); l.max_mrs as usize], "MR");
    assert_ne!(
        create_one::<RegMr>(&w, pd, region).0,
        IbStatus::Success,
        "MR past the limit"
    );
    destroy_all::<DeregMr>(&w, &mrs);
    let window = MwAttr {
        mw_type: MwType::Type2,
        rkey: RKey::new(0),
    };
    let mws = create_all::<AllocMw>(&w, &vec![(pd, window); l.max_mws as usize], "MW");
    assert_ne!(
        create_one::<AllocMw>(&w, pd, window).0,
        IbStatus::Success,
        "MW past the limit"
    );
    destroy_all::<DeallocMw>(&w, &mws);
    w.host.pool().free(block);

    destroy_all::<DestroyCq>(&w, &[cq, cq2]);
    destroy_all::<DeallocPd>(&w, &[pd]);
    w.finish();
}

#[test]
fn a_cq_never_takes_more_work_queue_entries_than_it_holds() {
    use ib_types::ioctl::{CreateCq, CreateSrq, DestroyCq, DestroySrq, ResizeCq};
    let w = World::deterministic(84);
    w.install_kernel_locker(0);
    let s = setup(&w, 0);
    let cq_of = |cqe| ib_types::cq::CqAttr {
        cqe,
        comp_vector: 0,
    };
    let (status, small) = create_one::<CreateCq>(&w, s.ca, cq_of(16));
    assert_eq!(status, IbStatus::Success);
    let wrs = |send, recv| QpCaps {
        max_send_wr: send,
        max_recv_wr: recv,
        ..ONE_WR
    };
    let rc = |send_cq, recv_cq, caps| qp_input(s.pd, send_cq, recv_cq, QpType::Rc, caps, None);

    // Guide 8.2.3 item 1: 8 sends and 8 receives fill the 16 entries;
    // one more WR anywhere could overflow the CQ, so the QP is refused.
    let (status, full) = create_one::<CreateQp>(&w, s.ca, rc(small, small, wrs(8, 8)));
    assert_eq!(status, IbStatus::Success);
    assert_eq!(
        create_one::<CreateQp>(&w, s.ca, rc(small, s.cq, wrs(1, 1))).0,
        IbStatus::InsufficientResources,
        "a send queue past the CQ's room"
    );
    assert_eq!(
        create_one::<CreateQp>(&w, s.ca, rc(s.cq, small, wrs(1, 1))).0,
        IbStatus::InsufficientResources,
        "a receive queue past the CQ's room"
    );
    // Nor may a resize shrink the CQ below its QPs' work queues; growing
    // it makes room.
    let resize = |cq: u64, cqe: u32| {
        let r = w.call_in_dpc::<ResizeCq>(KERNEL, cq, &cq_of(cqe), 0);
        response::<ResizeCq>(&r).status
    };
    assert_eq!(resize(small, 8), IbStatus::InvalidCqSize);
    assert_eq!(resize(small, 32), IbStatus::Success);
    let (status, second) = create_one::<CreateQp>(&w, s.ca, rc(small, small, wrs(8, 8)));
    assert_eq!(status, IbStatus::Success);
    assert_eq!(resize(small, 16), IbStatus::InvalidCqSize);
    // Destroying a QP gives its room back.
    destroy_all::<DestroyQp>(&w, &[second]);
    let (status, third) = create_one::<CreateQp>(&w, s.ca, rc(small, s.cq, wrs(16, 1)));
    assert_eq!(status, IbStatus::Success);
    destroy_all::<DestroyQp>(&w, &[full, third]);

    // Receives from an SRQ complete once each, whichever of its QPs takes
    // them: the SRQ's depth counts once per CQ.
    let srq_input = ib_types::srq::SrqCreate {
        pd: PdHandle::from_raw(s.pd),
        attr: ib_types::srq::SrqAttr {
            max_wr: 8,
            max_sge: 1,
            srq_limit: 0,
        },
    };
    let (status, srq) = create_one::<CreateSrq>(&w, s.ca, srq_input);
    assert_eq!(status, IbStatus::Success);
    let on_srq = QpCreate {
        srq: Some(ib_types::handle::SrqHandle::from_raw(srq)),
        ..rc(s.cq, small, wrs(1, 0))
    };
    let on_srq = QpCreate {
        caps: QpCaps {
            max_recv_wr: 0,
            max_recv_sge: 0,
            ..on_srq.caps
        },
        ..on_srq
    };
    let sharing = create_all::<CreateQp>(&w, &[(s.ca, on_srq); 3], "QP on the SRQ");
    // 32 entries: 8 for the SRQ, 16 + 8 for two send queues.
    let rest = create_all::<CreateQp>(
        &w,
        &[
            (s.ca, rc(small, s.cq, wrs(16, 1))),
            (s.ca, rc(small, s.cq, wrs(8, 1))),
        ],
        "send queues",
    );
    assert_eq!(
        create_one::<CreateQp>(&w, s.ca, rc(small, s.cq, wrs(1, 1))).0,
        IbStatus::InsufficientResources
    );
    destroy_all::<DestroyQp>(&w, &sharing);
    destroy_all::<DestroyQp>(&w, &rest);
    destroy_all::<DestroySrq>(&w, &[srq]);
    destroy_all::<DestroyCq>(&w, &[small]);
    let _ = poll_all(&w, 0, s.cq);
    teardown(&w, &s);
    w.finish();
}

#[test]
fn the_srq_depth_reported_is_the_one_the_core_builds_not_the_devices() {
    use ib_types::ioctl::{AllocPd, CreateSrq, DeallocPd, DestroySrq, OpenCa, OpenCaIn, QueryCa};
    // A device allowing deeper SRQs than the core's 16-bit WQE index.
    let mut device = small_device();
    device.limits.log_max_srq_wqes = 17;
    let w = World::with_hcas(
        85,
        vec![device],
        hca_miniport_core::init::HcaConfig::default(),
    );
    let r = w.call_in_dpc::<OpenCa>(KERNEL, 0, &OpenCaIn::CURRENT, 0);
    let ca = response::<OpenCa>(&r).handle;
    let r = w.call_in_dpc::<QueryCa>(KERNEL, ca, &Empty, 16);
    let needed = response::<QueryCa>(&r).output.unwrap().total_size;
    let r = w.call_in_dpc::<QueryCa>(KERNEL, ca, &Empty, needed);
    let l = ib_types::ca::CaAttrView::parse(response::<QueryCa>(&r).private)
        .unwrap()
        .attr()
        .limits;
    let (_, pd) = create_one::<AllocPd>(&w, ca, Empty);
    let srq_of = |max_wr| ib_types::srq::SrqCreate {
        pd: PdHandle::from_raw(pd),
        attr: ib_types::srq::SrqAttr {
            max_wr,
            max_sge: 1,
            srq_limit: 0,
        },
    };
    let (status, srq) = create_one::<CreateSrq>(&w, ca, srq_of(l.max_srq_wrs));
    assert_eq!(status, IbStatus::Success, "{} WRs", l.max_srq_wrs);
    assert_eq!(
        create_one::<CreateSrq>(&w, ca, srq_of(l.max_srq_wrs + 1)).0,
        IbStatus::InvalidSrqSize
    );
    destroy_all::<DestroySrq>(&w, &[srq]);
    destroy_all::<DeallocPd>(&w, &[pd]);
    w.finish();
}

#[test]
fn the_qp_depth_reported_is_what_a_cqe_wqe_index_names_not_the_devices() {
    use ib_types::ioctl::{AllocPd, CreateCq, DeallocPd, DestroyCq, OpenCa, OpenCaIn, QueryCa};
    // A device allowing rings deeper than a CQE's 16-bit `wqe_index` can
    // name (PRM 10.4): the core must build at most 2^16 units per ring.
    let mut device = small_device();
    device.limits.log_max_wqes = 17;
    device.limits.log_max_cqes = 17;
    let w = World::with_hcas(
        87,
        vec![device],
        hca_miniport_core::init::HcaConfig::default(),
    );
    let r = w.call_in_dpc::<OpenCa>(KERNEL, 0, &OpenCaIn::CURRENT, 0);
    let ca = response::<OpenCa>(&r).handle;
    let r = w.call_in_dpc::<QueryCa>(KERNEL, ca, &Empty, 16);
    let needed = response::<QueryCa>(&r).output.unwrap().total_size;
    let r = w.call_in_dpc::<QueryCa>(KERNEL, ca, &Empty, needed);
    let l = ib_types::ca::CaAttrView::parse(response::<QueryCa>(&r).private)
        .unwrap()
        .attr()
        .limits;
    assert_eq!(l.max_wrs_per_qp, 1 << 16);
    let (_, pd) = create_one::<AllocPd>(&w, ca, Empty);
    let cq_of = |cqe| ib_types::cq::CqAttr {
        cqe,
        comp_vector: 0,
    };
    let (status, cq) = create_one::<CreateCq>(&w, ca, cq_of(l.max_wrs_per_qp + 1));
    assert_eq!(status, IbStatus::Success);
    let rc = |caps: QpCaps| qp_input(pd, cq, cq, QpType::Rc, caps, None);
    for deepest in [
        QpCaps {
            max_send_wr: l.max_wrs_per_qp,
            ..ONE_WR
        },
        QpCaps {
            max_recv_wr: l.max_wrs_per_qp,
            ..ONE_WR
        },
    ] {
        let (status, qp) = create_one::<CreateQp>(&w, ca, rc(deepest));
        assert_eq!(status, IbStatus::Success, "{deepest:?}");
        destroy_all::<DestroyQp>(&w, &[qp]);
        let deeper = QpCaps {
            max_send_wr: deepest.max_send_wr * 2,
            max_recv_wr: deepest.max_recv_wr * 2,
            ..deepest
        };
        assert_eq!(
            create_one::<CreateQp>(&w, ca, rc(deeper)).0,
            IbStatus::InvalidMaxWrs,
            "{deeper:?}"
        );
    }
    // A WQE of two basic blocks halves the WRs the ring holds.
    let two_bbs = QpCaps {
        max_send_wr: l.max_wrs_per_qp / 2,
        max_send_sge: 4,
        ..ONE_WR
    };
    let (status, qp) = create_one::<CreateQp>(&w, ca, rc(two_bbs));
    assert_eq!(status, IbStatus::Success, "{two_bbs:?}");
    destroy_all::<DestroyQp>(&w, &[qp]);
    let too_deep = QpCaps {
        max_send_wr: l.max_wrs_per_qp,
        ..two_bbs
    };
    assert_eq!(
        create_one::<CreateQp>(&w, ca, rc(too_deep)).0,
        IbStatus::InvalidMaxWrs,
        "{too_deep:?}"
    );
    destroy_all::<DestroyCq>(&w, &[cq]);
    destroy_all::<DeallocPd>(&w, &[pd]);
    w.finish();
}

#[test]
fn the_inline_size_reported_fits_the_largest_send_wqe() {
    use ib_types::ioctl::{AllocPd, CreateCq, DeallocPd, DestroyCq, OpenCa, OpenCaIn, QueryCa};
    // 128-byte send WQEs: less inline room than the 256 bytes the device
    // would copy.
    let mut device = small_device();
    device.limits.log_max_wqe_size = 7;
    device.limits.max_inline_bytes = 256;
    let w = World::with_hcas(
        86,
        vec![device],
        hca_miniport_core::init::HcaConfig::default(),
    );
    let r = w.call_in_dpc::<OpenCa>(KERNEL, 0, &OpenCaIn::CURRENT, 0);
    let ca = response::<OpenCa>(&r).handle;
    let r = w.call_in_dpc::<QueryCa>(KERNEL, ca, &Empty, 16);
    let needed = response::<QueryCa>(&r).output.unwrap().total_size;
    let r = w.call_in_dpc::<QueryCa>(KERNEL, ca, &Empty, needed);
    let l = ib_types::ca::CaAttrView::parse(response::<QueryCa>(&r).private)
        .unwrap()
        .attr()
        .limits;
    let (_, pd) = create_one::<AllocPd>(&w, ca, Empty);
    let (_, cq) = create_one::<CreateCq>(
        &w,
        ca,
        ib_types::cq::CqAttr {
            cqe: 16,
            comp_vector: 0,
        },
    );
    let uc = |inline| {
        qp_input(
            pd,
            cq,
            cq,
            QpType::Uc,
            QpCaps {
                max_inline_data: inline,
                ..ONE_WR
            },
            None,
        )
    };
    let r = w.call_in_dpc::<CreateQp>(KERNEL, ca, &uc(l.max_inline_data), 0);
    let created = response::<CreateQp>(&r);
    assert_eq!(
        created.status,
        IbStatus::Success,
        "{} inline bytes",
        l.max_inline_data
    );
    assert_eq!(
        created.output.unwrap().caps.max_inline_data,
        l.max_inline_data
    );
    assert_eq!(
        create_one::<CreateQp>(&w, ca, uc(l.max_inline_data + 1)).0,
        IbStatus::InvalidParameter
    );
    destroy_all::<DestroyQp>(&w, &[created.handle]);
    destroy_all::<DestroyCq>(&w, &[cq]);
    destroy_all::<DeallocPd>(&w, &[pd]);
    w.finish();
}

/// Posts of 17 inline WRs through the CI fast path (past the provider's
/// UD batch size; a connected QP's WRs go to the core in one call, which
/// gathers each WR's bytes into the QP's inline scratch), of 200 bytes
/// each and of 8: every WR is posted, completes in order and lands whole.
#[test]
fn inline_batches_small_and_large_post_every_wr_in_order() {
    const WRS: usize = 17;
    let (w, [x, y]) = support::kernel_pair::two_two_port_hcas(83, GUIDS, &HCA_IPS);
    let (sx, sy) = (setup(&w, x), setup(&w, y));
    let input = QpCreate {
        qp_type: QpType::Rc,
        pd: PdHandle::from_raw(sx.pd),
        send_cq: CqHandle::from_raw(sx.cq),
        recv_cq: CqHandle::from_raw(sx.cq),
        srq: None,
        caps: QpCaps {
            max_send_wr: 32,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 200,
        },
        sq_sig_all: false,
        port: None,
    };
    let r = w.call_in_dpc_at::<CreateQp>(sx.i, KERNEL, sx.ca, &input, 0);
    let resp = response::<CreateQp>(&r);
    assert_eq!(resp.status, IbStatus::Success);
    let (a, qpn_a) = (resp.handle, resp.output.unwrap().qpn.get());
    let (b, qpn_b, _) = create_rc(&w, &sy, 0);
    connect(&w, x, a, qpn_b, HCA_IPS[1][0]);
    connect(&w, y, b, qpn_a, HCA_IPS[0][0]);

    let source = w
        .host
        .pool()
        .alloc(support::DRIVER, *b"InlB", 8192)
        .unwrap();
    let data = pattern(11, 8192);
    assert!(source.write(0, &data));
    let target = KernelBuf::register(
        &w,
        &sy,
        *b"InlB",
        2 * WRS * 256,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
    );
    // WR `n` of a batch of `len`-byte writes: its own source bytes to its
    // own place.
    let batch = |first_id: u64, len: u32, area: usize| -> Vec<SendWr<'static>> {
        (0..WRS)
            .map(|n| {
                let sge = leak(vec![Sge::new(
                    source.va() + (n * 7) as u64,
                    len,
                    ib_types::wr::LKey::new(0),
                )]);
                let op = SendOp::RdmaWrite {
                    remote: RemoteAddr {
                        addr: target.addr(area + n * 256),
                        rkey: target.keys.rkey,
                    },
                };
                inline_wr(first_id + n as u64, op, sge)
            })
            .collect()
    };
    // 17 x 200 bytes: large buffers, split at 16 WRs; 17 x 8 bytes: small.
    for (first_id, len, area) in [(100, 200u32, 0), (200, 8, WRS * 256)] {
        assert_eq!(
            ci_post_send(&w, x, a, batch(first_id, len, area)),
            (WRS, IbStatus::Success)
        );
        let sent = poll_all(&w, x, sx.cq);
        assert_eq!(
            sent.iter()
                .map(|wc| (wc.wr_id, wc.status))
                .collect::<Vec<_>>(),
            (0..WRS as u64)
                .map(|n| (first_id + n, WcStatus::Success))
                .collect::<Vec<_>>(),
        );
        for n in 0..WRS {
            let len = len as usize;
            assert_eq!(
                target.read(area + n * 256, len),
                data[n * 7..n * 7 + len],
                "WR {n} of {len} bytes"
            );
        }
    }

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
