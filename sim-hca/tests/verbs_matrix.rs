//! The verbs matrix: every opcode on every transport that supports it, every
//! completion error the device generates, duplicates, concurrent atomics,
//! memory windows, SRQs, QP state effects, ports and commands — two (or more)
//! simulated HCAs driven through the PRM by the test driver, data checked
//! byte for byte, completions checked for status, opcode and `wqe_index`.

mod common;

use common::*;
use hca_prm::av::Av;
use hca_prm::cmd::{CmdEntry, CmdStatus, Opcode, PortInfo};
use hca_prm::cqe::{Cqe, CqeFlags};
use hca_prm::ctx::{Cqc, QpcFlags};
use hca_prm::eqe::Event;
use hca_prm::mpt::{MptEntry, MptKind};
use hca_prm::wqe::{Bind, MwType, Payload, SendWqe, WqeFlags, WqeOp, WqeOpcode};
use hca_prm::{Le16, Le32, Le64};
use ib_types::abi::Be32;
use ib_types::access::AccessFlags;
use ib_types::av::AvAttr;
use ib_types::handle::{AvHandle, MwHandle};
use ib_types::qp::{QpModify, QpState, QpType};
use ib_types::scalars::{Gid, Mtu, PortNum, QKey, Qpn};
use ib_types::wc::WcStatus;
use ib_types::wr::{LKey, MwBind, RKey, RemoteAddr, SendFlags, SendOp, SendWr, Sge, UdDest};
use sim_hca::testkit::{Driver, Mr, Srq};
use zerocopy::{FromBytes, IntoBytes};

// ----- helpers ---------------------------------------------------------------

const SIG: SendFlags = SendFlags::SIGNALED;
const NONE: SendFlags = SendFlags::empty();
const QKEY: u32 = 0x1111_2222;

fn wr(wr_id: u64, op: SendOp, flags: SendFlags, sg: &[Sge]) -> SendWr<'_> {
    SendWr {
        wr_id,
        op,
        flags,
        sg_list: sg,
        ud: None,
    }
}

fn sge(mr: &Mr, at: u64, len: u32) -> Sge {
    Driver::sge(mr, at, len)
}

fn remote(mr: &Mr, off: u64) -> RemoteAddr {
    RemoteAddr {
        addr: mr.va + off,
        rkey: mr.rkey,
    }
}

fn imm(v: u32) -> Be32 {
    Be32::new(v)
}

/// Posts a send WR (rings the doorbell); returns its `wqe_index`.
fn post(node: &mut Node, ep: &mut Endpoint, w: &SendWr<'_>) -> u16 {
    let index = ep.qp.sq_producer as u16;
    node.drv
        .post_send(&mut node.dev, &mut ep.qp, w, None, None, true)
        .expect("a well-formed WR");
    index
}

/// Posts a send WR without ringing; returns its `wqe_index`.
fn post_quiet(node: &mut Node, ep: &mut Endpoint, w: &SendWr<'_>) -> u16 {
    let index = ep.qp.sq_producer as u16;
    node.drv
        .post_send(&mut node.dev, &mut ep.qp, w, None, None, false)
        .expect("a well-formed WR");
    index
}

/// Posts an inline send WR; returns its `wqe_index`.
fn post_inline(node: &mut Node, ep: &mut Endpoint, w: &SendWr<'_>, data: &[u8]) -> u16 {
    let index = ep.qp.sq_producer as u16;
    node.drv
        .post_send(&mut node.dev, &mut ep.qp, w, None, Some(data), true)
        .expect("a well-formed inline WR");
    index
}

/// Posts a UD send of `len` bytes at offset `at` of the endpoint's region to
/// `dest_qpn` at `dest_ip` (or a multicast group address); returns the
/// `wqe_index`.
fn post_ud(
    node: &mut Node,
    ep: &mut Endpoint,
    op: SendOp,
    sg: &[Sge],
    dest_ip: [u8; 4],
    dest_qpn: u32,
) -> u16 {
    let av = Av::try_from(&AvAttr::roce(PortNum::FIRST, Gid::from_ipv4(dest_ip), 0)).unwrap();
    let w = SendWr {
        wr_id: 1,
        op,
        flags: SIG,
        sg_list: sg,
        ud: Some(UdDest {
            av: AvHandle::from_raw(1),
            remote_qpn: Qpn::new(dest_qpn).unwrap(),
            remote_qkey: QKey::new(QKEY),
        }),
    };
    let index = ep.qp.sq_producer as u16;
    node.drv
        .post_send(&mut node.dev, &mut ep.qp, &w, Some(&av), None, true)
        .expect("a well-formed UD WR");
    index
}

/// Posts a receive of `len` bytes at offset `at` of the endpoint's region;
/// returns its `wqe_index`.
fn recv(node: &mut Node, ep: &mut Endpoint, at: u64, len: u32) -> u16 {
    let index = ep.qp.rq_producer as u16;
    let sg = sge(&ep.mr, at, len);
    node.drv.post_recv(&mut ep.qp, u64::from(index), &[sg]);
    index
}

fn cqes(node: &mut Node, ep: &mut Endpoint) -> Vec<Cqe> {
    node.drv.drain_cq(&mut ep.cq)
}

/// (opcode, status, wqe_index) of a completion.
fn c(op: WqeOpcode, status: WcStatus, index: u16) -> (u8, u8, u16) {
    (op.code(), status.code(), index)
}

fn ok(op: WqeOpcode, index: u16) -> (u8, u8, u16) {
    c(op, WcStatus::Success, index)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn rc_pair_with(mtu: Mtu, retries: Retries) -> (Pair, Endpoint, Endpoint) {
    let mut p = Pair::new();
    let a = endpoint(&mut p.a, QpType::Rc, AccessFlags::empty());
    let b = endpoint(&mut p.b, QpType::Rc, AccessFlags::empty());
    connect(&mut p, &a, &b, QpType::Rc, mtu, retries);
    (p, a, b)
}

fn rc_pair() -> (Pair, Endpoint, Endpoint) {
    rc_pair_with(Mtu::Mtu1024, Retries::PATIENT)
}

/// Brings a UD (or other datagram) endpoint to RTS with Q_Key [`QKEY`].
fn ud_ready(node: &mut Node, ep: &Endpoint) {
    let q = ep.qp.qp_type;
    for m in [
        bring_up::to_init(q, AccessFlags::empty(), QKEY),
        bring_up::to_rtr(q, [0; 4], 0, 0, Mtu::Mtu1024),
        bring_up::to_rts(q, 0, 0, 0, 0),
    ] {
        assert_eq!(node.drv.modify_qp(&mut node.dev, &ep.qp, &m), CmdStatus::Ok);
    }
}

fn ud_pair() -> (Pair, Endpoint, Endpoint) {
    let mut p = Pair::new();
    let a = endpoint(&mut p.a, QpType::Ud, AccessFlags::empty());
    let b = endpoint(&mut p.b, QpType::Ud, AccessFlags::empty());
    ud_ready(&mut p.a, &a);
    ud_ready(&mut p.b, &b);
    (p, a, b)
}

/// Registers a region of `len` bytes in `pd` with `access`.
fn reg(node: &mut Node, len: usize, pd: u32, access: AccessFlags) -> Mr {
    node.drv.reg_mr(&mut node.dev, len, pd, access).unwrap()
}

fn query_mpt(node: &mut Node, index: u32) -> Result<MptEntry, CmdStatus> {
    let (status, out) = node
        .drv
        .cmd(&mut node.dev, Opcode::QueryMpt, 0, index, &[], 64);
    if status != CmdStatus::Ok {
        return Err(status);
    }
    Ok(MptEntry::read_from_bytes(&out).unwrap())
}

fn query_port(node: &mut Node) -> PortInfo {
    let (status, out) = node
        .drv
        .cmd(&mut node.dev, Opcode::QueryPort, 0, 1, &[], 4096);
    assert_eq!(status, CmdStatus::Ok);
    PortInfo::read_from_prefix(&out).unwrap().0
}

/// A window key: the MPT index and a tag.
fn mw_key(index: u32, tag: u8) -> RKey {
    RKey::new(index << 8 | u32::from(tag))
}

/// A type 2 bind WR (the only kind verbs post).
fn bind2<'a>(
    wr_id: u64,
    key: RKey,
    mr: &Mr,
    off: u64,
    len: u64,
    access: AccessFlags,
) -> SendWr<'a> {
    wr(
        wr_id,
        SendOp::BindMw {
            mw: MwHandle::from_raw(1),
            rkey: key,
            bind: MwBind {
                mr_lkey: mr.lkey,
                addr: mr.va + off,
                length: len,
                access,
            },
        },
        SIG,
        &[],
    )
}

/// Posts a type 2 bind of `key` over `off..off+len` of `mr` (the
/// endpoint's own region when `None`); returns the `wqe_index`.
fn post_bind2(
    node: &mut Node,
    ep: &mut Endpoint,
    key: RKey,
    mr: Option<&Mr>,
    off: u64,
    len: u64,
    access: AccessFlags,
) -> u16 {
    let mr = *mr.unwrap_or(&ep.mr);
    post(node, ep, &bind2(1, key, &mr, off, len, access))
}

/// Posts a type 1 bind WQE (built directly: verbs binds only type 2).
fn post_bind1(
    node: &mut Node,
    ep: &mut Endpoint,
    key: RKey,
    mr: Option<&Mr>,
    off: u64,
    len: u64,
    access: AccessFlags,
) -> u16 {
    let mr = *mr.unwrap_or(&ep.mr);
    let index = ep.qp.sq_producer as u16;
    let wqe = SendWqe {
        wqe_index: index,
        flags: WqeFlags::SIGNALED,
        op: WqeOp::BindMw(Bind {
            new_rkey: key,
            mr_key: mr.lkey,
            va: mr.va + off,
            length: len,
            access,
            mw_type: MwType::Type1,
        }),
        ud: None,
        payload: Payload::Data(&[]),
    };
    node.drv
        .post_wqe(&mut node.dev, &mut ep.qp, &wqe, 0, true)
        .unwrap();
    index
}

const ALL_REMOTE: AccessFlags = AccessFlags::REMOTE_READ
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_ATOMIC);

// ----- 1. opcodes: RC -------------------------------------------------------

#[test]
fn rc_send_and_send_with_immediate() {
    let (mut p, mut a, mut b) = rc_pair();
    let r0 = recv(&mut p.b, &mut b, 0, 2048);
    let r1 = recv(&mut p.b, &mut b, 4096, 2048);
    let one = pattern(1500, 1);
    let two = pattern(300, 2);
    p.a.drv.write_mr(&a.mr, 0, &one);
    p.a.drv.write_mr(&a.mr, 2048, &two);
    let sg0 = [sge(&a.mr, 0, 1500)];
    let sg1 = [sge(&a.mr, 2048, 300)];
    let i0 = post(&mut p.a, &mut a, &wr(1, SendOp::Send, SIG, &sg0));
    let i1 = post(
        &mut p.a,
        &mut a,
        &wr(
            2,
            SendOp::SendWithImm {
                imm: imm(0x1122_3344),
            },
            SIG | SendFlags::SOLICITED,
            &sg1,
        ),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::Send, i0), ok(WqeOpcode::SendImm, i1)]
    );
    let got = cqes(&mut p.b, &mut b);
    assert_eq!(
        summary(&got),
        vec![ok(WqeOpcode::Send, r0), ok(WqeOpcode::SendImm, r1)]
    );
    assert_eq!(got[0].flags(), CqeFlags::RECV);
    assert_eq!(got[0].byte_count.get(), 1500);
    assert_eq!(got[0].qpn.get(), b.qp.qpn);
    assert_eq!(
        got[1].flags(),
        CqeFlags::RECV | CqeFlags::IMM | CqeFlags::SOLICITED
    );
    assert_eq!(got[1].byte_count.get(), 300);
    assert_eq!(got[1].imm, 0x1122_3344u32.to_be_bytes());
    assert_eq!(p.b.drv.read_mr(&b.mr, 0, 1500), one);
    assert_eq!(p.b.drv.read_mr(&b.mr, 4096, 300), two);
    // Nothing past the message was touched.
    assert_eq!(p.b.drv.read_mr(&b.mr, 1500, 548), vec![0; 548]);
}

#[test]
fn rc_send_with_invalidate_of_a_region() {
    let (mut p, mut a, mut b) = rc_pair();
    let target = reg(
        &mut p.b,
        4096,
        PD,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
    );
    assert_eq!(query_mpt(&mut p.b, target.index).unwrap().state, 1);
    let r0 = recv(&mut p.b, &mut b, 0, 256);
    let data = pattern(64, 9);
    p.a.drv.write_mr(&a.mr, 0, &data);
    let sg = [sge(&a.mr, 0, 64)];
    let i0 = post(
        &mut p.a,
        &mut a,
        &wr(
            1,
            SendOp::SendWithInvalidate { rkey: target.rkey },
            SIG,
            &sg,
        ),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::SendInv, i0)]
    );
    let got = cqes(&mut p.b, &mut b);
    assert_eq!(summary(&got), vec![ok(WqeOpcode::SendInv, r0)]);
    assert_eq!(got[0].flags(), CqeFlags::RECV | CqeFlags::INV);
    assert_eq!(got[0].imm, target.rkey.get().to_le_bytes());
    assert_eq!(got[0].byte_count.get(), 64);
    assert_eq!(p.b.drv.read_mr(&b.mr, 0, 64), data);
    // The region is invalid now: the MPT says so and a remote write fails.
    assert_eq!(query_mpt(&mut p.b, target.index).unwrap().state, 0);
    let i1 = post(
        &mut p.a,
        &mut a,
        &wr(
            2,
            SendOp::RdmaWrite {
                remote: remote(&target, 0),
            },
            SIG,
            &sg,
        ),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![c(WqeOpcode::RdmaWrite, WcStatus::RemAccessErr, i1)]
    );
}

#[test]
fn rc_send_with_invalidate_of_a_type2_window() {
    let (mut p, mut a, mut b) = rc_pair();
    let w =
        p.b.drv
            .alloc_mw(&mut p.b.dev, PD, MptKind::WindowType2)
            .unwrap();
    let key = mw_key(w, 0x42);
    let bi = post_bind2(
        &mut p.b,
        &mut b,
        key,
        None,
        1024,
        1024,
        AccessFlags::REMOTE_WRITE,
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b)),
        vec![ok(WqeOpcode::BindMw, bi)]
    );
    assert_eq!(
        query_mpt(&mut p.b, b.mr.index).unwrap().window_count.get(),
        1
    );
    // Write through the window, then invalidate it with the send.
    let data = pattern(100, 3);
    p.a.drv.write_mr(&a.mr, 0, &data);
    let sg = [sge(&a.mr, 0, 100)];
    let through = RemoteAddr {
        addr: b.mr.va + 1024,
        rkey: key,
    };
    let i0 = post(
        &mut p.a,
        &mut a,
        &wr(1, SendOp::RdmaWrite { remote: through }, SIG, &sg),
    );
    let r0 = recv(&mut p.b, &mut b, 8192, 128);
    let i1 = post(
        &mut p.a,
        &mut a,
        &wr(2, SendOp::SendWithInvalidate { rkey: key }, SIG, &sg),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::RdmaWrite, i0), ok(WqeOpcode::SendInv, i1)]
    );
    assert_eq!(p.b.drv.read_mr(&b.mr, 1024, 100), data);
    let got = cqes(&mut p.b, &mut b);
    assert_eq!(summary(&got), vec![ok(WqeOpcode::SendInv, r0)]);
    assert_eq!(got[0].flags(), CqeFlags::RECV | CqeFlags::INV);
    assert_eq!(got[0].imm, key.get().to_le_bytes());
    let window = query_mpt(&mut p.b, w).unwrap();
    assert_eq!(
        (window.kind, window.state),
        (MptKind::WindowType2.code(), 0)
    );
    assert_eq!(
        query_mpt(&mut p.b, b.mr.index).unwrap().window_count.get(),
        0
    );
    // The old key no longer grants anything.
    let i2 = post(
        &mut p.a,
        &mut a,
        &wr(3, SendOp::RdmaWrite { remote: through }, SIG, &sg),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![c(WqeOpcode::RdmaWrite, WcStatus::RemAccessErr, i2)]
    );
}

#[test]
fn rc_rdma_write_and_write_with_immediate() {
    let (mut p, mut a, mut b) = rc_pair();
    let data = pattern(2500, 5);
    p.a.drv.write_mr(&a.mr, 0, &data);
    let sg = [sge(&a.mr, 0, 2500)];
    let sg_small = [sge(&a.mr, 0, 700)];
    // A plain write (3 packets) consumes no receive WQE.
    let r0 = recv(&mut p.b, &mut b, 20_000, 64);
    let r1 = recv(&mut p.b, &mut b, 20_100, 64);
    let i0 = post(
        &mut p.a,
        &mut a,
        &wr(
            1,
            SendOp::RdmaWrite {
                remote: remote(&b.mr, 1000),
            },
            SIG,
            &sg,
        ),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::RdmaWrite, i0)]
    );
    assert!(
        cqes(&mut p.b, &mut b).is_empty(),
        "a write completes nothing at B"
    );
    assert_eq!(p.b.drv.read_mr(&b.mr, 1000, 2500), data);
    // Writes with immediate (one and three packets) each consume a receive
    // WQE and report the write's length; the receive buffer is untouched.
    let i1 = post(
        &mut p.a,
        &mut a,
        &wr(
            2,
            SendOp::RdmaWriteWithImm {
                remote: remote(&b.mr, 8000),
                imm: imm(0xA1B2_C3D4),
            },
            SIG,
            &sg_small,
        ),
    );
    let i2 = post(
        &mut p.a,
        &mut a,
        &wr(
            3,
            SendOp::RdmaWriteWithImm {
                remote: remote(&b.mr, 12_000),
                imm: imm(7),
            },
            SIG,
            &sg,
        ),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![
            ok(WqeOpcode::RdmaWriteImm, i1),
            ok(WqeOpcode::RdmaWriteImm, i2)
        ]
    );
    let got = cqes(&mut p.b, &mut b);
    assert_eq!(
        summary(&got),
        vec![
            ok(WqeOpcode::RdmaWriteImm, r0),
            ok(WqeOpcode::RdmaWriteImm, r1)
        ]
    );
    assert_eq!(got[0].flags(), CqeFlags::RECV | CqeFlags::IMM);
    assert_eq!(got[0].byte_count.get(), 700);
    assert_eq!(got[0].imm, 0xA1B2_C3D4u32.to_be_bytes());
    assert_eq!(got[1].byte_count.get(), 2500);
    assert_eq!(got[1].imm, 7u32.to_be_bytes());
    assert_eq!(p.b.drv.read_mr(&b.mr, 8000, 700), data[..700]);
    assert_eq!(p.b.drv.read_mr(&b.mr, 12_000, 2500), data);
    assert_eq!(p.b.drv.read_mr(&b.mr, 20_000, 164), vec![0; 164]);
}

#[test]
fn rc_rdma_read() {
    let (mut p, mut a, mut b) = rc_pair();
    let data = pattern(3000, 11);
    p.b.drv.write_mr(&b.mr, 5000, &data);
    let sg = [sge(&a.mr, 100, 3000)];
    let i0 = post(
        &mut p.a,
        &mut a,
        &wr(
            1,
            SendOp::RdmaRead {
                remote: remote(&b.mr, 5000),
            },
            SIG,
            &sg,
        ),
    );
    p.pump();
    let got = cqes(&mut p.a, &mut a);
    assert_eq!(summary(&got), vec![ok(WqeOpcode::RdmaRead, i0)]);
    assert_eq!(got[0].byte_count.get(), 3000);
    assert_eq!(p.a.drv.read_mr(&a.mr, 100, 3000), data);
    assert_eq!(p.a.drv.read_mr(&a.mr, 0, 100), vec![0; 100]);
    assert!(cqes(&mut p.b, &mut b).is_empty());
}

#[test]
fn rc_compare_swap_and_fetch_add() {
    let (mut p, mut a, b) = rc_pair();
    p.b.drv.write_mr(&b.mr, 64, &1000u64.to_le_bytes());
    let sg = |at| [sge(&a.mr, at, 8)];
    let (s0, s1, s2) = (sg(0), sg(8), sg(16));
    let word = remote(&b.mr, 64);
    // A compare that fails leaves the word; one that holds swaps it.
    let i0 = post(
        &mut p.a,
        &mut a,
        &wr(
            1,
            SendOp::CompareSwap {
                remote: word,
                compare: 999,
                swap: 5,
            },
            SIG,
            &s0,
        ),
    );
    let i1 = post(
        &mut p.a,
        &mut a,
        &wr(
            2,
            SendOp::CompareSwap {
                remote: word,
                compare: 1000,
                swap: 5,
            },
            SIG,
            &s1,
        ),
    );
    let i2 = post(
        &mut p.a,
        &mut a,
        &wr(
            3,
            SendOp::FetchAdd {
                remote: word,
                add: u64::MAX,
            },
            SIG,
            &s2,
        ),
    );
    p.pump();
    let got = cqes(&mut p.a, &mut a);
    assert_eq!(
        summary(&got),
        vec![
            ok(WqeOpcode::AtomicCs, i0),
            ok(WqeOpcode::AtomicCs, i1),
            ok(WqeOpcode::AtomicFa, i2)
        ]
    );
    assert!(got.iter().all(|c| c.byte_count.get() == 8));
    assert_eq!(p.a.drv.read_mr(&a.mr, 0, 8), 1000u64.to_le_bytes());
    assert_eq!(p.a.drv.read_mr(&a.mr, 8, 8), 1000u64.to_le_bytes());
    assert_eq!(p.a.drv.read_mr(&a.mr, 16, 8), 5u64.to_le_bytes());
    // 5 + (2^64 - 1) wraps to 4.
    assert_eq!(p.b.drv.read_mr(&b.mr, 64, 8), 4u64.to_le_bytes());
}

#[test]
fn rc_zero_length_write_and_read_skip_the_key_check() {
    let (mut p, mut a, mut b) = rc_pair();
    let garbage = RemoteAddr {
        addr: 0xdead_0000,
        rkey: RKey::new(0x00ff_ff77),
    };
    let i0 = post(
        &mut p.a,
        &mut a,
        &wr(1, SendOp::RdmaWrite { remote: garbage }, SIG, &[]),
    );
    let i1 = post(
        &mut p.a,
        &mut a,
        &wr(2, SendOp::RdmaRead { remote: garbage }, SIG, &[]),
    );
    p.pump();
    let got = cqes(&mut p.a, &mut a);
    assert_eq!(
        summary(&got),
        vec![ok(WqeOpcode::RdmaWrite, i0), ok(WqeOpcode::RdmaRead, i1)]
    );
    assert_eq!(got[1].byte_count.get(), 0);
    assert_eq!(p.a.qp_state(a.qp.qpn), QpState::Rts);
    assert_eq!(p.b.qp_state(b.qp.qpn), QpState::Rts);
    assert!(cqes(&mut p.b, &mut b).is_empty());
}

#[test]
fn rc_inline_send_and_write() {
    let (mut p, mut a, mut b) = rc_pair();
    let r0 = recv(&mut p.b, &mut b, 0, 256);
    let msg = pattern(100, 21);
    let blob = pattern(200, 22);
    // The SGE describes the length only: its key would fail a gather, so a
    // success proves the device took the bytes from the WQE.
    let bogus = |len| [Sge::new(0x1000, len, LKey::new(0xffff_ff00))];
    let (g0, g1) = (bogus(100), bogus(200));
    let i0 = post_inline(
        &mut p.a,
        &mut a,
        &wr(1, SendOp::Send, SIG | SendFlags::INLINE, &g0),
        &msg,
    );
    let i1 = post_inline(
        &mut p.a,
        &mut a,
        &wr(
            2,
            SendOp::RdmaWrite {
                remote: remote(&b.mr, 4096),
            },
            SIG | SendFlags::INLINE,
            &g1,
        ),
        &blob,
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::Send, i0), ok(WqeOpcode::RdmaWrite, i1)]
    );
    let got = cqes(&mut p.b, &mut b);
    assert_eq!(summary(&got), vec![ok(WqeOpcode::Send, r0)]);
    assert_eq!(got[0].byte_count.get(), 100);
    assert_eq!(p.b.drv.read_mr(&b.mr, 0, 100), msg);
    assert_eq!(p.b.drv.read_mr(&b.mr, 4096, 200), blob);
}

#[test]
fn rc_fenced_read_after_write_and_write_after_read() {
    let (mut p, mut a, b) = rc_pair();
    // Write then a fenced read of the same bytes returns what was written.
    let data = pattern(512, 30);
    p.a.drv.write_mr(&a.mr, 0, &data);
    let sg_w = [sge(&a.mr, 0, 512)];
    let sg_r = [sge(&a.mr, 1024, 512)];
    let i0 = post(
        &mut p.a,
        &mut a,
        &wr(
            1,
            SendOp::RdmaWrite {
                remote: remote(&b.mr, 0),
            },
            SIG,
            &sg_w,
        ),
    );
    let i1 = post(
        &mut p.a,
        &mut a,
        &wr(
            2,
            SendOp::RdmaRead {
                remote: remote(&b.mr, 0),
            },
            SIG | SendFlags::FENCE,
            &sg_r,
        ),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::RdmaWrite, i0), ok(WqeOpcode::RdmaRead, i1)]
    );
    assert_eq!(p.a.drv.read_mr(&a.mr, 1024, 512), data);
    // Read into a buffer, then a fenced write of that buffer: the write
    // waits for the read, so it carries the read's data, not stale bytes.
    let fresh = pattern(512, 31);
    p.b.drv.write_mr(&b.mr, 8192, &fresh);
    let sg_r = [sge(&a.mr, 4096, 512)];
    let sg_w = [sge(&a.mr, 4096, 512)];
    let i2 = post_quiet(
        &mut p.a,
        &mut a,
        &wr(
            3,
            SendOp::RdmaRead {
                remote: remote(&b.mr, 8192),
            },
            SIG,
            &sg_r,
        ),
    );
    let i3 = post(
        &mut p.a,
        &mut a,
        &wr(
            4,
            SendOp::RdmaWrite {
                remote: remote(&b.mr, 16_384),
            },
            SIG | SendFlags::FENCE,
            &sg_w,
        ),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::RdmaRead, i2), ok(WqeOpcode::RdmaWrite, i3)]
    );
    assert_eq!(p.b.drv.read_mr(&b.mr, 16_384, 512), fresh);
}

#[test]
fn rc_unsignaled_wqes_complete_silently_before_a_signaled_one() {
    let (mut p, mut a, mut b) = rc_pair();
    let rs: Vec<u16> = (0..4)
        .map(|k| recv(&mut p.b, &mut b, k * 256, 256))
        .collect();
    let sgs: Vec<[Sge; 1]> = (0..4).map(|k| [sge(&a.mr, k * 64, 64)]).collect();
    p.a.drv.write_mr(&a.mr, 0, &pattern(256, 40));
    let mut last = 0;
    for (k, sg) in sgs.iter().enumerate() {
        let flags = if k == 3 { SIG } else { NONE };
        last = post(&mut p.a, &mut a, &wr(k as u64, SendOp::Send, flags, sg));
    }
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::Send, last)]
    );
    let got = cqes(&mut p.b, &mut b);
    assert_eq!(
        summary(&got),
        rs.iter()
            .map(|&r| ok(WqeOpcode::Send, r))
            .collect::<Vec<_>>()
    );
    for k in 0..4 {
        assert_eq!(
            p.b.drv.read_mr(&b.mr, k * 256, 64),
            p.a.drv.read_mr(&a.mr, k * 64, 64)
        );
    }
}

#[test]
fn rc_sq_sig_all_signals_every_wqe() {
    let mut p = Pair::new();
    let mut a = endpoint_with(
        &mut p.a,
        QpType::Rc,
        8,
        QpcFlags::SQ_SIG_ALL,
        AccessFlags::empty(),
    );
    let b = endpoint(&mut p.b, QpType::Rc, AccessFlags::empty());
    connect(&mut p, &a, &b, QpType::Rc, Mtu::Mtu1024, Retries::PATIENT);
    let sg = [sge(&a.mr, 0, 16)];
    let i0 = post(
        &mut p.a,
        &mut a,
        &wr(
            1,
            SendOp::RdmaWrite {
                remote: remote(&b.mr, 0),
            },
            NONE,
            &sg,
        ),
    );
    let i1 = post(
        &mut p.a,
        &mut a,
        &wr(
            2,
            SendOp::RdmaWrite {
                remote: remote(&b.mr, 64),
            },
            NONE,
            &sg,
        ),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::RdmaWrite, i0), ok(WqeOpcode::RdmaWrite, i1)]
    );
}

#[test]
fn rc_bind_mw_and_local_invalidate() {
    let (mut p, mut a, mut b) = rc_pair();
    let w =
        p.b.drv
            .alloc_mw(&mut p.b.dev, PD, MptKind::WindowType2)
            .unwrap();
    let key = mw_key(w, 0x10);
    let i0 = post_bind2(
        &mut p.b,
        &mut b,
        key,
        None,
        0,
        4096,
        AccessFlags::REMOTE_READ,
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b)),
        vec![ok(WqeOpcode::BindMw, i0)]
    );
    let window = query_mpt(&mut p.b, w).unwrap();
    assert_eq!((window.state, window.tag), (1, 0x10));
    assert_eq!(window.bound_qpn.get(), b.qp.qpn);
    assert_eq!(window.bound_mr.get(), b.mr.index);
    // Read through it.
    let data = pattern(128, 50);
    p.b.drv.write_mr(&b.mr, 0, &data);
    let sg = [sge(&a.mr, 0, 128)];
    let r = RemoteAddr {
        addr: b.mr.va,
        rkey: key,
    };
    let ia = post(
        &mut p.a,
        &mut a,
        &wr(1, SendOp::RdmaRead { remote: r }, SIG, &sg),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::RdmaRead, ia)]
    );
    assert_eq!(p.a.drv.read_mr(&a.mr, 0, 128), data);
    // LOCAL_INV returns the window to free.
    let i1 = post(
        &mut p.b,
        &mut b,
        &wr(2, SendOp::LocalInvalidate { rkey: key }, SIG, &[]),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b)),
        vec![ok(WqeOpcode::LocalInv, i1)]
    );
    assert_eq!(query_mpt(&mut p.b, w).unwrap().state, 0);
    assert_eq!(
        query_mpt(&mut p.b, b.mr.index).unwrap().window_count.get(),
        0
    );
}

// ----- 1. opcodes: UC -------------------------------------------------------

fn uc_pair() -> (Pair, Endpoint, Endpoint) {
    let mut p = Pair::new();
    let a = endpoint(&mut p.a, QpType::Uc, AccessFlags::empty());
    let b = endpoint(&mut p.b, QpType::Uc, AccessFlags::empty());
    connect(&mut p, &a, &b, QpType::Uc, Mtu::Mtu1024, Retries::PATIENT);
    (p, a, b)
}

#[test]
fn uc_send_write_and_immediates_multi_packet() {
    let (mut p, mut a, mut b) = uc_pair();
    let data = pattern(3000, 60);
    p.a.drv.write_mr(&a.mr, 0, &data);
    let r0 = recv(&mut p.b, &mut b, 0, 4096);
    let r1 = recv(&mut p.b, &mut b, 4096, 4096);
    let r2 = recv(&mut p.b, &mut b, 8192, 64);
    let sg_big = [sge(&a.mr, 0, 3000)];
    let sg_small = [sge(&a.mr, 0, 100)];
    let i0 = post(&mut p.a, &mut a, &wr(1, SendOp::Send, SIG, &sg_big));
    let i1 = post(
        &mut p.a,
        &mut a,
        &wr(2, SendOp::SendWithImm { imm: imm(0x55) }, SIG, &sg_small),
    );
    let i2 = post(
        &mut p.a,
        &mut a,
        &wr(
            3,
            SendOp::RdmaWrite {
                remote: remote(&b.mr, 16_384),
            },
            SIG,
            &sg_big,
        ),
    );
    let i3 = post(
        &mut p.a,
        &mut a,
        &wr(
            4,
            SendOp::RdmaWriteWithImm {
                remote: remote(&b.mr, 24_576),
                imm: imm(0x66),
            },
            SIG,
            &sg_big,
        ),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![
            ok(WqeOpcode::Send, i0),
            ok(WqeOpcode::SendImm, i1),
            ok(WqeOpcode::RdmaWrite, i2),
            ok(WqeOpcode::RdmaWriteImm, i3)
        ]
    );
    let got = cqes(&mut p.b, &mut b);
    assert_eq!(
        summary(&got),
        vec![
            ok(WqeOpcode::Send, r0),
            ok(WqeOpcode::SendImm, r1),
            ok(WqeOpcode::RdmaWriteImm, r2)
        ]
    );
    assert_eq!(
        got.iter().map(|c| c.byte_count.get()).collect::<Vec<_>>(),
        vec![3000, 100, 3000]
    );
    assert_eq!(got[1].imm, 0x55u32.to_be_bytes());
    assert_eq!(got[2].imm, 0x66u32.to_be_bytes());
    assert_eq!(p.b.drv.read_mr(&b.mr, 0, 3000), data);
    assert_eq!(p.b.drv.read_mr(&b.mr, 4096, 100), data[..100]);
    assert_eq!(p.b.drv.read_mr(&b.mr, 16_384, 3000), data);
    assert_eq!(p.b.drv.read_mr(&b.mr, 24_576, 3000), data);
    assert_eq!(p.b.drv.read_mr(&b.mr, 8192, 64), vec![0; 64]);
}

#[test]
fn uc_write_with_immediate_without_a_receive_is_dropped_alone() {
    // UC has no RNR: a message that finds no receive WQE is dropped. The
    // next message must not be affected (IBA 9.7.5.1.x: UC responders
    // resume at the next FIRST or ONLY).
    let (mut p, mut a, mut b) = uc_pair();
    let data = pattern(64, 61);
    p.a.drv.write_mr(&a.mr, 0, &data);
    let sg = [sge(&a.mr, 0, 64)];
    let i0 = post(
        &mut p.a,
        &mut a,
        &wr(
            1,
            SendOp::RdmaWriteWithImm {
                remote: remote(&b.mr, 0),
                imm: imm(1),
            },
            SIG,
            &sg,
        ),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::RdmaWriteImm, i0)]
    );
    assert!(cqes(&mut p.b, &mut b).is_empty());
    let r0 = recv(&mut p.b, &mut b, 4096, 64);
    let i1 = post(&mut p.a, &mut a, &wr(2, SendOp::Send, SIG, &sg));
    let i2 = post(
        &mut p.a,
        &mut a,
        &wr(
            3,
            SendOp::RdmaWrite {
                remote: remote(&b.mr, 8192),
            },
            SIG,
            &sg,
        ),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::Send, i1), ok(WqeOpcode::RdmaWrite, i2)]
    );
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b)),
        vec![ok(WqeOpcode::Send, r0)]
    );
    assert_eq!(p.b.drv.read_mr(&b.mr, 4096, 64), data);
    assert_eq!(p.b.drv.read_mr(&b.mr, 8192, 64), data);
    assert_eq!(p.b.qp_state(b.qp.qpn), QpState::Rts);
}

// ----- 1. opcodes: UD -------------------------------------------------------

#[test]
fn ud_send_and_send_with_immediate() {
    let (mut p, mut a, mut b) = ud_pair();
    let r0 = recv(&mut p.b, &mut b, 0, 40 + 1024);
    let r1 = recv(&mut p.b, &mut b, 2048, 40 + 16);
    let data = pattern(1024, 70);
    p.a.drv.write_mr(&a.mr, 0, &data);
    let sg0 = [sge(&a.mr, 0, 1024)];
    let sg1 = [sge(&a.mr, 0, 16)];
    let bq = b.qp.qpn;
    let i0 = post_ud(&mut p.a, &mut a, SendOp::Send, &sg0, IP_B, bq);
    let i1 = post_ud(
        &mut p.a,
        &mut a,
        SendOp::SendWithImm { imm: imm(0xBEEF) },
        &sg1,
        IP_B,
        bq,
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::Send, i0), ok(WqeOpcode::SendImm, i1)]
    );
    let got = cqes(&mut p.b, &mut b);
    assert_eq!(
        summary(&got),
        vec![ok(WqeOpcode::Send, r0), ok(WqeOpcode::SendImm, r1)]
    );
    assert_eq!(got[0].flags(), CqeFlags::RECV | CqeFlags::GRH);
    assert_eq!(got[0].byte_count.get(), 40 + 1024);
    assert_eq!(got[0].src_qp.get(), a.qp.qpn);
    assert_eq!(
        got[1].flags(),
        CqeFlags::RECV | CqeFlags::GRH | CqeFlags::IMM
    );
    assert_eq!(got[1].byte_count.get(), 40 + 16);
    assert_eq!(got[1].imm, 0xBEEFu32.to_be_bytes());
    assert_eq!(p.b.drv.read_mr(&b.mr, 40, 1024), data);
    assert_eq!(p.b.drv.read_mr(&b.mr, 2048 + 40, 16), data[..16]);
}

#[test]
fn ud_message_over_the_mtu_fails_locally_and_stops_only_the_send_queue() {
    let (mut p, mut a, mut b) = ud_pair();
    let mtu = query_port(&mut p.a).active_mtu;
    let too_big = Mtu::from_code(mtu).unwrap().bytes() + 1;
    let sg_big = [sge(&a.mr, 0, too_big)];
    let sg = [sge(&a.mr, 0, 32)];
    let bq = b.qp.qpn;
    recv(&mut p.b, &mut b, 0, 8192);
    // Post both, ring once: the first fails, the second is flushed.
    let av = Av::try_from(&AvAttr::roce(PortNum::FIRST, Gid::from_ipv4(IP_B), 0)).unwrap();
    let mk = |sg| SendWr {
        wr_id: 1,
        op: SendOp::Send,
        flags: SIG,
        sg_list: sg,
        ud: Some(UdDest {
            av: AvHandle::from_raw(1),
            remote_qpn: Qpn::new(bq).unwrap(),
            remote_qkey: QKey::new(QKEY),
        }),
    };
    let i0 = a.qp.sq_producer as u16;
    p.a.drv
        .post_send(
            &mut p.a.dev,
            &mut a.qp,
            &mk(&sg_big[..]),
            Some(&av),
            None,
            false,
        )
        .unwrap();
    let i1 = a.qp.sq_producer as u16;
    p.a.drv
        .post_send(&mut p.a.dev, &mut a.qp, &mk(&sg[..]), Some(&av), None, true)
        .unwrap();
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![
            c(WqeOpcode::Send, WcStatus::LocLenErr, i0),
            c(WqeOpcode::Send, WcStatus::WrFlushErr, i1)
        ]
    );
    assert_eq!(p.a.qp_state(a.qp.qpn), QpState::Sqe);
    assert!(cqes(&mut p.b, &mut b).is_empty(), "nothing went out");
    // The receive queue keeps working in SQE.
    let ra = recv(&mut p.a, &mut a, 8192, 40 + 32);
    let sgb = [sge(&b.mr, 0, 32)];
    let aq = a.qp.qpn;
    let ib = post_ud(&mut p.b, &mut b, SendOp::Send, &sgb, IP_A, aq);
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b)),
        vec![ok(WqeOpcode::Send, ib)]
    );
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::Send, ra)]
    );
    // SQE -> RTS resumes the send queue.
    assert_eq!(
        p.a.drv
            .modify_qp(&mut p.a.dev, &a.qp, &QpModify::to_state(QpState::Rts)),
        CmdStatus::Ok
    );
    let i2 = post_ud(&mut p.a, &mut a, SendOp::Send, &sg, IP_B, bq);
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::Send, i2)]
    );
    assert_eq!(cqes(&mut p.b, &mut b).len(), 1);
}

// ----- 2. every error status ------------------------------------------------

#[test]
fn loc_len_err_receive_buffer_too_small() {
    let (mut p, mut a, mut b) = rc_pair();
    let r0 = recv(&mut p.b, &mut b, 0, 100);
    let r1 = recv(&mut p.b, &mut b, 1024, 100);
    let sg = [sge(&a.mr, 0, 200)];
    let i0 = post(&mut p.a, &mut a, &wr(1, SendOp::Send, SIG, &sg));
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![c(WqeOpcode::Send, WcStatus::RemInvReqErr, i0)]
    );
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b)),
        vec![
            c(WqeOpcode::Send, WcStatus::LocLenErr, r0),
            c(WqeOpcode::Send, WcStatus::WrFlushErr, r1)
        ]
    );
    assert_eq!(p.a.qp_state(a.qp.qpn), QpState::Err);
    assert_eq!(p.b.qp_state(b.qp.qpn), QpState::Err);
}

#[test]
fn loc_prot_err_bad_lkey_in_a_send() {
    let (mut p, mut a, mut b) = rc_pair();
    recv(&mut p.b, &mut b, 0, 256);
    let bad = [Sge::new(a.mr.va, 16, LKey::new(a.mr.lkey.get() ^ 0x01))];
    let sg = [sge(&a.mr, 0, 16)];
    let i0 = post_quiet(&mut p.a, &mut a, &wr(1, SendOp::Send, SIG, &bad));
    let i1 = post(&mut p.a, &mut a, &wr(2, SendOp::Send, SIG, &sg));
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![
            c(WqeOpcode::Send, WcStatus::LocProtErr, i0),
            c(WqeOpcode::Send, WcStatus::WrFlushErr, i1)
        ]
    );
    assert_eq!(p.a.qp_state(a.qp.qpn), QpState::Err);
    assert_eq!(p.a.dev.port_counters(1).unwrap().tx_packets, 0);
    assert!(cqes(&mut p.b, &mut b).is_empty());
}

#[test]
fn loc_prot_err_region_of_another_pd() {
    let (mut p, mut a, mut b) = rc_pair();
    recv(&mut p.b, &mut b, 0, 256);
    let other = reg(&mut p.a, 4096, PD + 1, AccessFlags::LOCAL_WRITE);
    let sg = [sge(&other, 0, 16)];
    let i0 = post(&mut p.a, &mut a, &wr(1, SendOp::Send, SIG, &sg));
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![c(WqeOpcode::Send, WcStatus::LocProtErr, i0)]
    );
    assert_eq!(p.a.qp_state(a.qp.qpn), QpState::Err);
    assert!(cqes(&mut p.b, &mut b).is_empty());
}

#[test]
fn loc_qp_op_err_garbage_wqe() {
    let (mut p, mut a, b) = rc_pair();
    // Opcode 0x7F does not exist; the index and size are right.
    let mut raw = [0u8; 64];
    raw[0] = 0x7F;
    raw[1] = WqeFlags::SIGNALED.bits();
    raw[2] = 1;
    let i0 = a.qp.sq_producer as u16;
    p.a.drv.write_sq_raw(&a.qp, a.qp.sq_producer, &raw);
    a.qp.sq_producer += 1;
    let sg = [sge(&a.mr, 0, 16)];
    let target = remote(&b.mr, 0);
    let i1 = post(
        &mut p.a,
        &mut a,
        &wr(2, SendOp::RdmaWrite { remote: target }, SIG, &sg),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![
            c(WqeOpcode::Nop, WcStatus::LocQpOpErr, i0),
            c(WqeOpcode::RdmaWrite, WcStatus::WrFlushErr, i1)
        ]
    );
    assert_eq!(p.a.qp_state(a.qp.qpn), QpState::Err);
    assert_eq!(p.a.dev.port_counters(1).unwrap().tx_packets, 0);
}

#[test]
fn loc_qp_op_err_wqe_index_mismatch() {
    let (mut p, mut a, _b) = rc_pair();
    // A NOP whose wqe_index is not its slot's.
    let mut raw = [0u8; 64];
    raw[1] = WqeFlags::SIGNALED.bits();
    raw[2] = 1;
    raw[4..6].copy_from_slice(&7u16.to_le_bytes());
    let i0 = a.qp.sq_producer as u16;
    p.a.drv.write_sq_raw(&a.qp, a.qp.sq_producer, &raw);
    a.qp.sq_producer += 1;
    p.a.drv.ring_sq(&mut p.a.dev, &a.qp);
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![c(WqeOpcode::Nop, WcStatus::LocQpOpErr, i0)]
    );
    assert_eq!(p.a.qp_state(a.qp.qpn), QpState::Err);
}

#[test]
fn mw_bind_err_type2_window_bound_twice() {
    let (mut p, mut a, _b) = rc_pair();
    let w =
        p.a.drv
            .alloc_mw(&mut p.a.dev, PD, MptKind::WindowType2)
            .unwrap();
    let r = AccessFlags::REMOTE_READ;
    let i0 = post_bind2(&mut p.a, &mut a, mw_key(w, 1), None, 0, 64, r);
    let i1 = post_bind2(&mut p.a, &mut a, mw_key(w, 2), None, 0, 64, r);
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![
            ok(WqeOpcode::BindMw, i0),
            c(WqeOpcode::BindMw, WcStatus::MwBindErr, i1)
        ]
    );
    assert_eq!(p.a.qp_state(a.qp.qpn), QpState::Err);
    // The first binding stands.
    assert_eq!(query_mpt(&mut p.a, w).unwrap().tag, 1);
}

/// IBA o10-37.2.40 (rxe `rxe_check_bind_mw` likewise): a type 2 window is
/// unbound only by invalidation; a zero-length bind of one fails with
/// `MW_BIND_ERR` and leaves the window free (a type 1 window's zero-length
/// bind is how it unbinds, PRM 7.1).
#[test]
fn mw_bind_err_zero_length_type2_bind() {
    let (mut p, mut a, _b) = rc_pair();
    let w =
        p.a.drv
            .alloc_mw(&mut p.a.dev, PD, MptKind::WindowType2)
            .unwrap();
    let before = query_mpt(&mut p.a, w).unwrap();
    let i0 = post_bind2(
        &mut p.a,
        &mut a,
        mw_key(w, before.tag.wrapping_add(1)),
        None,
        0,
        0,
        AccessFlags::REMOTE_READ,
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![c(WqeOpcode::BindMw, WcStatus::MwBindErr, i0)]
    );
    assert_eq!(p.a.qp_state(a.qp.qpn), QpState::Err);
    let window = query_mpt(&mut p.a, w).unwrap();
    assert_eq!(
        (window.state, window.tag),
        (0, before.tag),
        "still free, key unchanged"
    );
}

#[test]
fn mw_bind_err_region_without_mw_bind() {
    let (mut p, mut a, _b) = rc_pair();
    let plain = reg(
        &mut p.a,
        4096,
        PD,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
    );
    let w =
        p.a.drv
            .alloc_mw(&mut p.a.dev, PD, MptKind::WindowType2)
            .unwrap();
    let i0 = post_bind2(
        &mut p.a,
        &mut a,
        mw_key(w, 1),
        Some(&plain),
        0,
        64,
        AccessFlags::REMOTE_READ,
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![c(WqeOpcode::BindMw, WcStatus::MwBindErr, i0)]
    );
    assert_eq!(query_mpt(&mut p.a, w).unwrap().state, 0);
    assert_eq!(
        query_mpt(&mut p.a, plain.index).unwrap().window_count.get(),
        0
    );
}

#[test]
fn mw_bind_err_remote_write_window_over_region_without_local_write() {
    let (mut p, mut a, _b) = rc_pair();
    let ro = reg(
        &mut p.a,
        4096,
        PD,
        AccessFlags::MW_BIND | AccessFlags::REMOTE_READ,
    );
    let w1 =
        p.a.drv
            .alloc_mw(&mut p.a.dev, PD, MptKind::WindowType2)
            .unwrap();
    let w2 =
        p.a.drv
            .alloc_mw(&mut p.a.dev, PD, MptKind::WindowType2)
            .unwrap();
    // A read-only window over it is fine; a writable one is not.
    let i0 = post_bind2(
        &mut p.a,
        &mut a,
        mw_key(w1, 1),
        Some(&ro),
        0,
        64,
        AccessFlags::REMOTE_READ,
    );
    let i1 = post_bind2(
        &mut p.a,
        &mut a,
        mw_key(w2, 1),
        Some(&ro),
        0,
        64,
        AccessFlags::REMOTE_WRITE,
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![
            ok(WqeOpcode::BindMw, i0),
            c(WqeOpcode::BindMw, WcStatus::MwBindErr, i1)
        ]
    );
    assert_eq!(query_mpt(&mut p.a, w2).unwrap().state, 0);
    assert_eq!(query_mpt(&mut p.a, ro.index).unwrap().window_count.get(), 1);
}

#[test]
fn mw_bind_err_local_invalidate_of_a_type1_window() {
    let (mut p, mut a, _b) = rc_pair();
    let w =
        p.a.drv
            .alloc_mw(&mut p.a.dev, PD, MptKind::WindowType1)
            .unwrap();
    let key = mw_key(w, 3);
    let i0 = post_bind1(&mut p.a, &mut a, key, None, 0, 64, AccessFlags::REMOTE_READ);
    let i1 = post(
        &mut p.a,
        &mut a,
        &wr(2, SendOp::LocalInvalidate { rkey: key }, SIG, &[]),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![
            ok(WqeOpcode::BindMw, i0),
            c(WqeOpcode::LocalInv, WcStatus::MwBindErr, i1)
        ]
    );
    assert_eq!(query_mpt(&mut p.a, w).unwrap().state, 1, "still bound");
}

#[test]
fn rem_inv_req_err_misaligned_atomic() {
    let (mut p, mut a, b) = rc_pair();
    p.b.drv.write_mr(&b.mr, 0, &[0xAA; 16]);
    let sg = [sge(&a.mr, 0, 8)];
    let i0 = post(
        &mut p.a,
        &mut a,
        &wr(
            1,
            SendOp::FetchAdd {
                remote: remote(&b.mr, 4),
                add: 1,
            },
            SIG,
            &sg,
        ),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![c(WqeOpcode::AtomicFa, WcStatus::RemInvReqErr, i0)]
    );
    assert_eq!(
        p.b.drv.read_mr(&b.mr, 0, 16),
        vec![0xAA; 16],
        "not executed"
    );
    assert_eq!(p.a.qp_state(a.qp.qpn), QpState::Err);
    assert_eq!(p.b.qp_state(b.qp.qpn), QpState::Err);
}

#[test]
fn rem_inv_req_err_write_to_a_qp_without_remote_write() {
    let (mut p, mut a, b) = rc_pair();
    // B's QP allows reads only (RTS -> RTS with new access flags).
    let m = QpModify {
        access: Some(AccessFlags::REMOTE_READ),
        ..QpModify::default()
    };
    assert_eq!(p.b.drv.modify_qp(&mut p.b.dev, &b.qp, &m), CmdStatus::Ok);
    let sg = [sge(&a.mr, 0, 16)];
    let i0 = post(
        &mut p.a,
        &mut a,
        &wr(
            1,
            SendOp::RdmaRead {
                remote: remote(&b.mr, 0),
            },
            SIG,
            &sg,
        ),
    );
    let i1 = post(
        &mut p.a,
        &mut a,
        &wr(
            2,
            SendOp::RdmaWrite {
                remote: remote(&b.mr, 0),
            },
            SIG,
            &sg,
        ),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![
            ok(WqeOpcode::RdmaRead, i0),
            c(WqeOpcode::RdmaWrite, WcStatus::RemInvReqErr, i1)
        ]
    );
    assert_eq!(p.b.qp_state(b.qp.qpn), QpState::Err);
}

#[test]
fn rem_access_err_rkey_range() {
    let (mut p, mut a, b) = rc_pair();
    let sg = [sge(&a.mr, 0, 16)];
    // The last 8 bytes of the region and 8 past it.
    let i0 = post(
        &mut p.a,
        &mut a,
        &wr(
            1,
            SendOp::RdmaWrite {
                remote: remote(&b.mr, b.mr.len - 8),
            },
            SIG,
            &sg,
        ),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![c(WqeOpcode::RdmaWrite, WcStatus::RemAccessErr, i0)]
    );
    assert_eq!(
        p.b.drv.read_mr(&b.mr, b.mr.len as usize - 8, 8),
        vec![0; 8],
        "nothing written"
    );
    assert_eq!(p.b.qp_state(b.qp.qpn), QpState::Err);
}

#[test]
fn rem_op_err_send_with_invalidate_of_a_type1_window() {
    let (mut p, mut a, mut b) = rc_pair();
    let w =
        p.b.drv
            .alloc_mw(&mut p.b.dev, PD, MptKind::WindowType1)
            .unwrap();
    let key = mw_key(w, 9);
    let bi = post_bind1(
        &mut p.b,
        &mut b,
        key,
        None,
        0,
        4096,
        AccessFlags::REMOTE_READ,
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b)),
        vec![ok(WqeOpcode::BindMw, bi)]
    );
    let r0 = recv(&mut p.b, &mut b, 0, 256);
    let sg = [sge(&a.mr, 0, 16)];
    let i0 = post(
        &mut p.a,
        &mut a,
        &wr(1, SendOp::SendWithInvalidate { rkey: key }, SIG, &sg),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![c(WqeOpcode::SendInv, WcStatus::RemOpErr, i0)]
    );
    // The responder's receive completes in error (the PRM leaves its status
    // open; the device reports the same remote operational error).
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b)),
        vec![c(WqeOpcode::Send, WcStatus::RemOpErr, r0)]
    );
    assert_eq!(query_mpt(&mut p.b, w).unwrap().state, 1, "still bound");
    assert_eq!(p.b.qp_state(b.qp.qpn), QpState::Err);
}

#[test]
fn retry_exc_err_when_the_peer_never_answers() {
    let (mut p, mut a, mut b) = rc_pair_with(
        Mtu::Mtu1024,
        Retries {
            timeout: 4,
            retry: 2,
            rnr_retry: 7,
        },
    );
    recv(&mut p.b, &mut b, 0, 256);
    p.filter = Some(Box::new(|_, _| false));
    let sg = [sge(&a.mr, 0, 16)];
    let i0 = post(&mut p.a, &mut a, &wr(1, SendOp::Send, SIG, &sg));
    p.advance(1_000_000);
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![c(WqeOpcode::Send, WcStatus::RetryExcErr, i0)]
    );
    // The first transmission and two retries.
    assert_eq!(p.a.dev.port_counters(1).unwrap().tx_packets, 3);
    assert_eq!(p.a.qp_state(a.qp.qpn), QpState::Err);
    assert!(cqes(&mut p.b, &mut b).is_empty());
}

#[test]
fn rnr_retry_exc_err_without_a_receive() {
    let (mut p, mut a, mut b) = rc_pair_with(
        Mtu::Mtu1024,
        Retries {
            timeout: 14,
            retry: 7,
            rnr_retry: 1,
        },
    );
    let sg = [sge(&a.mr, 0, 16)];
    let i0 = post(&mut p.a, &mut a, &wr(1, SendOp::Send, SIG, &sg));
    p.advance(10_000_000);
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![c(WqeOpcode::Send, WcStatus::RnrRetryExcErr, i0)]
    );
    // The first transmission and one RNR retry, each RNR NAKed.
    assert_eq!(p.a.dev.port_counters(1).unwrap().tx_packets, 2);
    assert_eq!(p.b.dev.port_counters(1).unwrap().tx_packets, 2);
    assert_eq!(p.a.qp_state(a.qp.qpn), QpState::Err);
    assert!(cqes(&mut p.b, &mut b).is_empty());
}

#[test]
fn wr_flush_err_on_both_queues_and_an_unsignaled_error() {
    let (mut p, mut a, b) = rc_pair();
    let ra0 = recv(&mut p.a, &mut a, 8192, 64);
    let ra1 = recv(&mut p.a, &mut a, 8192 + 64, 64);
    let bad = RemoteAddr {
        addr: b.mr.va,
        rkey: RKey::new(b.mr.rkey.get() ^ 0x40),
    };
    let sg = [sge(&a.mr, 0, 16)];
    let i0 = post_quiet(
        &mut p.a,
        &mut a,
        &wr(1, SendOp::RdmaWrite { remote: bad }, NONE, &sg),
    );
    let i1 = post_quiet(&mut p.a, &mut a, &wr(2, SendOp::Send, SIG, &sg));
    let i2 = post(&mut p.a, &mut a, &wr(3, SendOp::Send, NONE, &sg));
    p.pump();
    let got = cqes(&mut p.a, &mut a);
    let (recvs, sends): (Vec<Cqe>, Vec<Cqe>) =
        got.iter().partition(|c| c.flags().contains(CqeFlags::RECV));
    assert_eq!(
        summary(&sends),
        vec![
            c(WqeOpcode::RdmaWrite, WcStatus::RemAccessErr, i0),
            c(WqeOpcode::Send, WcStatus::WrFlushErr, i1),
            c(WqeOpcode::Send, WcStatus::WrFlushErr, i2)
        ]
    );
    assert_eq!(
        summary(&recvs),
        vec![
            c(WqeOpcode::Send, WcStatus::WrFlushErr, ra0),
            c(WqeOpcode::Send, WcStatus::WrFlushErr, ra1)
        ]
    );
    assert!(recvs.iter().all(|c| c.qpn.get() == a.qp.qpn));
    // Work posted in ERR is flushed too (the send doorbell makes the
    // device look at both queues).
    let ra2 = recv(&mut p.a, &mut a, 8192, 64);
    let i3 = post(&mut p.a, &mut a, &wr(4, SendOp::Send, NONE, &sg));
    p.pump();
    let got = cqes(&mut p.a, &mut a);
    let mut kinds: Vec<_> = summary(&got);
    kinds.sort_unstable();
    let mut want = vec![
        c(WqeOpcode::Send, WcStatus::WrFlushErr, i3),
        c(WqeOpcode::Send, WcStatus::WrFlushErr, ra2),
    ];
    want.sort_unstable();
    assert_eq!(kinds, want);
    assert_eq!(
        got.iter()
            .filter(|c| c.flags().contains(CqeFlags::RECV))
            .count(),
        1
    );
}

// ----- 3. duplicates --------------------------------------------------------

/// A filter that drops the first `n` frames from B to A (responses).
fn drop_first_responses(n: usize) -> FrameFilter {
    let mut dropped = 0;
    Box::new(move |to_b, _| {
        if !to_b && dropped < n {
            dropped += 1;
            false
        } else {
            true
        }
    })
}

#[test]
fn duplicate_send_and_write_are_acked_not_redelivered() {
    let (mut p, mut a, mut b) = rc_pair_with(
        Mtu::Mtu1024,
        Retries {
            timeout: 8,
            retry: 7,
            rnr_retry: 7,
        },
    );
    let r0 = recv(&mut p.b, &mut b, 0, 256);
    let r1 = recv(&mut p.b, &mut b, 256, 256);
    let data = pattern(64, 80);
    p.a.drv.write_mr(&a.mr, 0, &data);
    let sg = [sge(&a.mr, 0, 64)];
    p.filter = Some(drop_first_responses(1));
    let i0 = post(&mut p.a, &mut a, &wr(1, SendOp::Send, SIG, &sg));
    p.pump();
    assert!(cqes(&mut p.a, &mut a).is_empty(), "the ACK was lost");
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b)),
        vec![ok(WqeOpcode::Send, r0)]
    );
    p.advance(10_000_000);
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::Send, i0)]
    );
    assert!(cqes(&mut p.b, &mut b).is_empty(), "not delivered twice");
    assert_eq!(p.b.dev.port_counters(1).unwrap().tx_packets, 2, "re-ACKed");
    // The write's duplicate is acknowledged, not re-executed: B's CPU
    // overwrites the target between the original and the retransmission.
    p.filter = Some(drop_first_responses(1));
    let i1 = post(
        &mut p.a,
        &mut a,
        &wr(
            2,
            SendOp::RdmaWrite {
                remote: remote(&b.mr, 4096),
            },
            SIG,
            &sg,
        ),
    );
    p.pump();
    assert_eq!(p.b.drv.read_mr(&b.mr, 4096, 64), data);
    p.b.drv.write_mr(&b.mr, 4096, &[0x5A; 64]);
    p.advance(10_000_000);
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::RdmaWrite, i1)]
    );
    assert_eq!(p.b.drv.read_mr(&b.mr, 4096, 64), vec![0x5A; 64]);
    // The next message takes the next receive WQE.
    let i2 = post(&mut p.a, &mut a, &wr(3, SendOp::Send, SIG, &sg));
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::Send, i2)]
    );
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b)),
        vec![ok(WqeOpcode::Send, r1)]
    );
}

#[test]
fn duplicate_write_with_immediate_completes_one_receive() {
    let (mut p, mut a, mut b) = rc_pair_with(
        Mtu::Mtu1024,
        Retries {
            timeout: 8,
            retry: 7,
            rnr_retry: 7,
        },
    );
    let r0 = recv(&mut p.b, &mut b, 0, 16);
    recv(&mut p.b, &mut b, 16, 16);
    let sg = [sge(&a.mr, 0, 64)];
    p.filter = Some(drop_first_responses(1));
    let i0 = post(
        &mut p.a,
        &mut a,
        &wr(
            1,
            SendOp::RdmaWriteWithImm {
                remote: remote(&b.mr, 4096),
                imm: imm(3),
            },
            SIG,
            &sg,
        ),
    );
    p.advance(10_000_000);
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::RdmaWriteImm, i0)]
    );
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b)),
        vec![ok(WqeOpcode::RdmaWriteImm, r0)]
    );
}

#[test]
fn duplicate_read_is_replayed_from_the_responder_resource() {
    let (mut p, mut a, b) = rc_pair_with(
        Mtu::Mtu1024,
        Retries {
            timeout: 8,
            retry: 7,
            rnr_retry: 7,
        },
    );
    let data = pattern(2500, 90);
    p.b.drv.write_mr(&b.mr, 0, &data);
    // Lose the whole first response stream (3 packets).
    p.filter = Some(drop_first_responses(3));
    let sg = [sge(&a.mr, 0, 2500)];
    let i0 = post(
        &mut p.a,
        &mut a,
        &wr(
            1,
            SendOp::RdmaRead {
                remote: remote(&b.mr, 0),
            },
            SIG,
            &sg,
        ),
    );
    p.pump();
    assert!(cqes(&mut p.a, &mut a).is_empty());
    p.advance(10_000_000);
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::RdmaRead, i0)]
    );
    assert_eq!(p.a.drv.read_mr(&a.mr, 0, 2500), data);
    assert_eq!(p.b.dev.port_counters(1).unwrap().tx_packets, 6, "replayed");
    assert_eq!(p.b.qp_state(b.qp.qpn), QpState::Rts);
}

#[test]
fn duplicate_atomic_is_answered_from_the_cache_not_re_executed() {
    let (mut p, mut a, b) = rc_pair_with(
        Mtu::Mtu1024,
        Retries {
            timeout: 8,
            retry: 7,
            rnr_retry: 7,
        },
    );
    p.b.drv.write_mr(&b.mr, 64, &40u64.to_le_bytes());
    p.filter = Some(drop_first_responses(1));
    let sg = [sge(&a.mr, 0, 8)];
    let i0 = post(
        &mut p.a,
        &mut a,
        &wr(
            1,
            SendOp::FetchAdd {
                remote: remote(&b.mr, 64),
                add: 2,
            },
            SIG,
            &sg,
        ),
    );
    p.pump();
    assert_eq!(p.b.drv.read_mr(&b.mr, 64, 8), 42u64.to_le_bytes());
    assert!(cqes(&mut p.a, &mut a).is_empty());
    p.advance(10_000_000);
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::AtomicFa, i0)]
    );
    assert_eq!(p.a.drv.read_mr(&a.mr, 0, 8), 40u64.to_le_bytes());
    assert_eq!(
        p.b.drv.read_mr(&b.mr, 64, 8),
        42u64.to_le_bytes(),
        "executed once"
    );
    assert_eq!(p.a.dev.port_counters(1).unwrap().tx_packets, 2);
}

#[test]
fn rnr_on_write_with_immediate_then_retry_succeeds() {
    let (mut p, mut a, mut b) = rc_pair();
    let data = pattern(2500, 95);
    p.a.drv.write_mr(&a.mr, 0, &data);
    let sg1 = [sge(&a.mr, 0, 100)];
    let sg3 = [sge(&a.mr, 0, 2500)];
    // One packet, then three packets: no receive WQE, RNR NAK, retry.
    for (k, sg) in [&sg1[..], &sg3[..]].into_iter().enumerate() {
        let i = post(
            &mut p.a,
            &mut a,
            &wr(
                1,
                SendOp::RdmaWriteWithImm {
                    remote: remote(&b.mr, 8192 * (k as u64 + 1)),
                    imm: imm(k as u32),
                },
                SIG,
                sg,
            ),
        );
        p.pump();
        assert!(cqes(&mut p.a, &mut a).is_empty(), "RNR: not complete yet");
        let r = recv(&mut p.b, &mut b, 0, 16);
        p.advance(1_000_000);
        assert_eq!(
            summary(&cqes(&mut p.a, &mut a)),
            vec![ok(WqeOpcode::RdmaWriteImm, i)]
        );
        let got = cqes(&mut p.b, &mut b);
        assert_eq!(summary(&got), vec![ok(WqeOpcode::RdmaWriteImm, r)]);
        assert_eq!(got[0].byte_count.get(), sg[0].length.get());
        assert_eq!(
            p.b.drv
                .read_mr(&b.mr, 8192 * (k + 1), sg[0].length.get() as usize),
            data[..sg[0].length.get() as usize]
        );
        assert_eq!(p.b.qp_state(b.qp.qpn), QpState::Rts);
    }
}

#[test]
fn malformed_receive_wqe_completes_in_error() {
    // PRM 10.5: a WQE that fails gets its error CQE; IBA (responder class
    // A): a malformed receive WQE is retired in error, the requester gets
    // a remote operational error.
    let (mut p, mut a, mut b) = rc_pair();
    let r0 = recv(&mut p.b, &mut b, 0, 256);
    // num_sges far beyond what the stride holds.
    let mut header = [0u8; 16];
    header[0] = 200;
    header[2..4].copy_from_slice(&r0.to_le_bytes());
    p.b.drv.write_rq_raw(&b.qp, u32::from(r0), &header);
    let r1 = recv(&mut p.b, &mut b, 1024, 256);
    let sg = [sge(&a.mr, 0, 16)];
    let i0 = post(&mut p.a, &mut a, &wr(1, SendOp::Send, SIG, &sg));
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![c(WqeOpcode::Send, WcStatus::RemOpErr, i0)]
    );
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b)),
        vec![
            c(WqeOpcode::Send, WcStatus::LocQpOpErr, r0),
            c(WqeOpcode::Send, WcStatus::WrFlushErr, r1)
        ]
    );
    assert_eq!(p.b.qp_state(b.qp.qpn), QpState::Err);
}

// ----- 4. concurrent atomics ------------------------------------------------

#[test]
fn concurrent_fetch_adds_from_two_qps_are_linearizable() {
    let mut p = Pair::new();
    let mut a1 = endpoint(&mut p.a, QpType::Rc, AccessFlags::empty());
    let mut a2 = endpoint(&mut p.a, QpType::Rc, AccessFlags::empty());
    let b1 = endpoint(&mut p.b, QpType::Rc, AccessFlags::empty());
    let b2 = endpoint(&mut p.b, QpType::Rc, AccessFlags::empty());
    connect(&mut p, &a1, &b1, QpType::Rc, Mtu::Mtu1024, Retries::PATIENT);
    connect(&mut p, &a2, &b2, QpType::Rc, Mtu::Mtu1024, Retries::PATIENT);
    let word = remote(&b1.mr, 0);
    const N: u64 = 50;
    let mut want = [Vec::new(), Vec::new()];
    for k in 0..N {
        for (q, ep) in [&mut a1, &mut a2].into_iter().enumerate() {
            let sg = [sge(&ep.mr, 8 * k, 8)];
            let i = post(
                &mut p.a,
                ep,
                &wr(
                    k,
                    SendOp::FetchAdd {
                        remote: word,
                        add: 1,
                    },
                    SIG,
                    &sg,
                ),
            );
            want[q].push(ok(WqeOpcode::AtomicFa, i));
        }
    }
    p.pump();
    assert_eq!(summary(&cqes(&mut p.a, &mut a1)), want[0]);
    assert_eq!(summary(&cqes(&mut p.a, &mut a2)), want[1]);
    let mut olds = Vec::new();
    for ep in [&a1, &a2] {
        let raw = p.a.drv.read_mr(&ep.mr, 0, 8 * N as usize);
        let mine: Vec<u64> = raw
            .chunks(8)
            .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
            .collect();
        // Each QP's atomics execute in its order.
        assert!(mine.windows(2).all(|w| w[0] < w[1]), "{mine:?}");
        olds.extend(mine);
    }
    olds.sort_unstable();
    assert_eq!(olds, (0..2 * N).collect::<Vec<_>>());
    assert_eq!(p.b.drv.read_mr(&b1.mr, 0, 8), (2 * N).to_le_bytes());
}

// ----- 5. memory windows ----------------------------------------------------

/// B binds a type 1 window (read/write over b.mr[4096..8192]) and a type 2
/// window (read over b.mr[8192..12288]) on its QP.
fn mw_setup() -> (Pair, Endpoint, Endpoint, RKey, RKey) {
    let (mut p, a, mut b) = rc_pair();
    let w1 =
        p.b.drv
            .alloc_mw(&mut p.b.dev, PD, MptKind::WindowType1)
            .unwrap();
    let w2 =
        p.b.drv
            .alloc_mw(&mut p.b.dev, PD, MptKind::WindowType2)
            .unwrap();
    let (k1, k2) = (mw_key(w1, 0x11), mw_key(w2, 0x22));
    let rw = AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
    let i0 = post_bind1(&mut p.b, &mut b, k1, None, 4096, 4096, rw);
    let i1 = post_bind2(
        &mut p.b,
        &mut b,
        k2,
        None,
        8192,
        4096,
        AccessFlags::REMOTE_READ,
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b)),
        vec![ok(WqeOpcode::BindMw, i0), ok(WqeOpcode::BindMw, i1)]
    );
    assert_eq!(
        query_mpt(&mut p.b, b.mr.index).unwrap().window_count.get(),
        2
    );
    (p, a, b, k1, k2)
}

fn at(mr: &Mr, off: u64, rkey: RKey) -> RemoteAddr {
    RemoteAddr {
        addr: mr.va + off,
        rkey,
    }
}

#[test]
fn mw_access_within_range_and_rights() {
    let (mut p, mut a, b, k1, k2) = mw_setup();
    let data = pattern(64, 100);
    p.a.drv.write_mr(&a.mr, 0, &data);
    let fresh = pattern(64, 101);
    p.b.drv.write_mr(&b.mr, 8192 + 4096 - 64, &fresh);
    let sg = [sge(&a.mr, 0, 64)];
    let sg_r1 = [sge(&a.mr, 1024, 64)];
    let sg_r2 = [sge(&a.mr, 2048, 64)];
    let i0 = post(
        &mut p.a,
        &mut a,
        &wr(
            1,
            SendOp::RdmaWrite {
                remote: at(&b.mr, 4096 + 100, k1),
            },
            SIG,
            &sg,
        ),
    );
    let i1 = post(
        &mut p.a,
        &mut a,
        &wr(
            2,
            SendOp::RdmaRead {
                remote: at(&b.mr, 4096 + 100, k1),
            },
            SIG,
            &sg_r1,
        ),
    );
    let i2 = post(
        &mut p.a,
        &mut a,
        &wr(
            3,
            SendOp::RdmaRead {
                remote: at(&b.mr, 8192 + 4096 - 64, k2),
            },
            SIG,
            &sg_r2,
        ),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![
            ok(WqeOpcode::RdmaWrite, i0),
            ok(WqeOpcode::RdmaRead, i1),
            ok(WqeOpcode::RdmaRead, i2)
        ]
    );
    assert_eq!(p.b.drv.read_mr(&b.mr, 4096 + 100, 64), data);
    assert_eq!(p.a.drv.read_mr(&a.mr, 1024, 64), data);
    assert_eq!(p.a.drv.read_mr(&a.mr, 2048, 64), fresh);
}

#[test]
fn mw_access_outside_range_or_rights_is_a_remote_access_error() {
    type Case = fn(&Mr, RKey, RKey) -> (SendOp, u32);
    let cases: [(&str, Case); 5] = [
        ("write through a read-only window", |m, _, k2| {
            (
                SendOp::RdmaWrite {
                    remote: at(m, 8192, k2),
                },
                16,
            )
        }),
        ("read past the end", |m, k1, _| {
            (
                SendOp::RdmaRead {
                    remote: at(m, 8192 - 32, k1),
                },
                64,
            )
        }),
        ("read before the start", |m, _, k2| {
            (
                SendOp::RdmaRead {
                    remote: at(m, 8192 - 8, k2),
                },
                16,
            )
        }),
        ("atomic without REMOTE_ATOMIC", |m, k1, _| {
            (
                SendOp::FetchAdd {
                    remote: at(m, 4096, k1),
                    add: 1,
                },
                8,
            )
        }),
        ("a key whose tag is wrong", |m, k1, _| {
            (
                SendOp::RdmaRead {
                    remote: at(m, 4096, RKey::new(k1.get() ^ 0x3)),
                },
                16,
            )
        }),
    ];
    for (what, case) in cases {
        let (mut p, mut a, b, k1, k2) = mw_setup();
        let (op, len) = case(&b.mr, k1, k2);
        let sg = [sge(&a.mr, 0, len)];
        let i0 = post(&mut p.a, &mut a, &wr(1, op, SIG, &sg));
        p.pump();
        let opcode = WqeOpcode::from_wr(op.opcode());
        assert_eq!(
            summary(&cqes(&mut p.a, &mut a)),
            vec![c(opcode, WcStatus::RemAccessErr, i0)],
            "{what}"
        );
        assert_eq!(p.b.drv.read_mr(&b.mr, 4096, 16), vec![0; 16], "{what}");
        assert_eq!(p.b.drv.read_mr(&b.mr, 8192, 16), vec![0; 16], "{what}");
    }
}

#[test]
fn mw_rkey_changes_on_every_bind() {
    // Type 1: rebinding a bound window replaces its key.
    let (mut p, mut a, mut b, k1, _) = mw_setup();
    let w1 = k1.get() >> 8;
    let k1b = mw_key(w1, 0x12);
    let i0 = post_bind1(
        &mut p.b,
        &mut b,
        k1b,
        None,
        0,
        1024,
        AccessFlags::REMOTE_READ,
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b)),
        vec![ok(WqeOpcode::BindMw, i0)]
    );
    let entry = query_mpt(&mut p.b, w1).unwrap();
    assert_eq!((entry.state, entry.tag), (1, 0x12));
    assert_eq!(entry.length.get(), 1024);
    assert_eq!(
        query_mpt(&mut p.b, b.mr.index).unwrap().window_count.get(),
        2,
        "the rebind moved the window, it did not add one"
    );
    let sg = [sge(&a.mr, 0, 16)];
    let i1 = post(
        &mut p.a,
        &mut a,
        &wr(
            1,
            SendOp::RdmaRead {
                remote: at(&b.mr, 0, k1b),
            },
            SIG,
            &sg,
        ),
    );
    let i2 = post(
        &mut p.a,
        &mut a,
        &wr(
            2,
            SendOp::RdmaRead {
                remote: at(&b.mr, 4096, k1),
            },
            SIG,
            &sg,
        ),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![
            ok(WqeOpcode::RdmaRead, i1),
            c(WqeOpcode::RdmaRead, WcStatus::RemAccessErr, i2)
        ]
    );

    // Type 2: invalidate, rebind with a new key; the old one is refused.
    let (mut p, mut a, mut b, _, k2) = mw_setup();
    let w2 = k2.get() >> 8;
    let k2b = mw_key(w2, 0x23);
    let i0 = post(
        &mut p.b,
        &mut b,
        &wr(1, SendOp::LocalInvalidate { rkey: k2 }, SIG, &[]),
    );
    let i1 = post_bind2(
        &mut p.b,
        &mut b,
        k2b,
        None,
        8192,
        4096,
        AccessFlags::REMOTE_READ,
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b)),
        vec![ok(WqeOpcode::LocalInv, i0), ok(WqeOpcode::BindMw, i1)]
    );
    assert_eq!(query_mpt(&mut p.b, w2).unwrap().tag, 0x23);
    let sg = [sge(&a.mr, 0, 16)];
    let i2 = post(
        &mut p.a,
        &mut a,
        &wr(
            1,
            SendOp::RdmaRead {
                remote: at(&b.mr, 8192, k2b),
            },
            SIG,
            &sg,
        ),
    );
    let i3 = post(
        &mut p.a,
        &mut a,
        &wr(
            2,
            SendOp::RdmaRead {
                remote: at(&b.mr, 8192, k2),
            },
            SIG,
            &sg,
        ),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![
            ok(WqeOpcode::RdmaRead, i2),
            c(WqeOpcode::RdmaRead, WcStatus::RemAccessErr, i3)
        ]
    );
}

#[test]
fn mw_type2_window_serves_only_the_qp_it_is_bound_to() {
    let mut p = Pair::new();
    let mut a1 = endpoint(&mut p.a, QpType::Rc, AccessFlags::empty());
    let mut a2 = endpoint(&mut p.a, QpType::Rc, AccessFlags::empty());
    let mut b1 = endpoint(&mut p.b, QpType::Rc, AccessFlags::empty());
    let b2 = endpoint(&mut p.b, QpType::Rc, AccessFlags::empty());
    connect(&mut p, &a1, &b1, QpType::Rc, Mtu::Mtu1024, Retries::PATIENT);
    connect(&mut p, &a2, &b2, QpType::Rc, Mtu::Mtu1024, Retries::PATIENT);
    let w1 =
        p.b.drv
            .alloc_mw(&mut p.b.dev, PD, MptKind::WindowType1)
            .unwrap();
    let w2 =
        p.b.drv
            .alloc_mw(&mut p.b.dev, PD, MptKind::WindowType2)
            .unwrap();
    let (k1, k2) = (mw_key(w1, 5), mw_key(w2, 6));
    let r = AccessFlags::REMOTE_READ;
    let i0 = post_bind1(&mut p.b, &mut b1, k1, None, 0, 4096, r);
    let i1 = post_bind2(&mut p.b, &mut b1, k2, None, 0, 4096, r);
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b1)),
        vec![ok(WqeOpcode::BindMw, i0), ok(WqeOpcode::BindMw, i1)]
    );
    assert_eq!(query_mpt(&mut p.b, w2).unwrap().bound_qpn.get(), b1.qp.qpn);
    let data = pattern(32, 110);
    p.b.drv.write_mr(&b1.mr, 0, &data);
    // The owner QP may use both; the other QP only the type 1 window.
    let read = |k| SendOp::RdmaRead {
        remote: at(&b1.mr, 0, k),
    };
    let sg1 = [sge(&a1.mr, 0, 32)];
    let sg2 = [sge(&a2.mr, 0, 32)];
    let j0 = post(&mut p.a, &mut a1, &wr(1, read(k2), SIG, &sg1));
    let j1 = post(&mut p.a, &mut a2, &wr(1, read(k1), SIG, &sg2));
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a1)),
        vec![ok(WqeOpcode::RdmaRead, j0)]
    );
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a2)),
        vec![ok(WqeOpcode::RdmaRead, j1)]
    );
    assert_eq!(p.a.drv.read_mr(&a1.mr, 0, 32), data);
    assert_eq!(p.a.drv.read_mr(&a2.mr, 0, 32), data);
    let j2 = post(&mut p.a, &mut a2, &wr(2, read(k2), SIG, &sg2));
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a2)),
        vec![c(WqeOpcode::RdmaRead, WcStatus::RemAccessErr, j2)]
    );
}

#[test]
fn mw_deregistering_a_region_with_bound_windows_is_busy() {
    let (mut p, mut a, mut b, k1, k2) = mw_setup();
    let busy =
        p.b.drv
            .cmd_param(&mut p.b.dev, Opcode::Hw2SwMpt, b.mr.index, 0);
    assert_eq!(busy.0, CmdStatus::ResourceBusy);
    // The region is untouched: remote access still works.
    let sg = [sge(&a.mr, 0, 16)];
    let i0 = post(
        &mut p.a,
        &mut a,
        &wr(
            1,
            SendOp::RdmaWrite {
                remote: remote(&b.mr, 0),
            },
            SIG,
            &sg,
        ),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::RdmaWrite, i0)]
    );
    // Invalidate the type 2 window and free the type 1 window: then the
    // region can go.
    let i1 = post(
        &mut p.b,
        &mut b,
        &wr(1, SendOp::LocalInvalidate { rkey: k2 }, SIG, &[]),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b)),
        vec![ok(WqeOpcode::LocalInv, i1)]
    );
    let still =
        p.b.drv
            .cmd_param(&mut p.b.dev, Opcode::Hw2SwMpt, b.mr.index, 0);
    assert_eq!(
        still.0,
        CmdStatus::ResourceBusy,
        "the type 1 window is bound"
    );
    let w1 = k1.get() >> 8;
    assert_eq!(
        p.b.drv.cmd_param(&mut p.b.dev, Opcode::Hw2SwMpt, w1, 0).0,
        CmdStatus::Ok
    );
    assert_eq!(
        query_mpt(&mut p.b, b.mr.index).unwrap().window_count.get(),
        0
    );
    assert_eq!(
        p.b.drv
            .cmd_param(&mut p.b.dev, Opcode::Hw2SwMpt, b.mr.index, 0)
            .0,
        CmdStatus::Ok
    );
    assert_eq!(
        query_mpt(&mut p.b, b.mr.index).unwrap_err(),
        CmdStatus::BadResState
    );
}

// ----- 6. SRQ ---------------------------------------------------------------

fn srq_endpoint(node: &mut Node, srq: &Srq) -> Endpoint {
    let cq = node.drv.create_cq(&mut node.dev, 8).unwrap();
    let qp = node
        .drv
        .create_qp(
            &mut node.dev,
            QpType::Rc,
            1,
            PD,
            &cq,
            &cq,
            Some(srq),
            (6, 6),
        )
        .unwrap();
    let mr = reg(node, 16 * 1024, PD, AccessFlags::LOCAL_WRITE | ALL_REMOTE);
    Endpoint { cq, qp, mr }
}

fn srq_recv(node: &mut Node, srq: &mut Srq, mr: &Mr, at: u64, len: u32) -> u16 {
    let index = srq.producer as u16;
    node.drv
        .post_srq_recv(srq, u64::from(index), &[sge(mr, at, len)]);
    index
}

#[test]
fn srq_feeds_two_qps() {
    let mut p = Pair::new();
    let mut srq = p.b.drv.create_srq(&mut p.b.dev, PD, 4, 0).unwrap();
    let mut b1 = srq_endpoint(&mut p.b, &srq);
    let mut b2 = srq_endpoint(&mut p.b, &srq);
    let mut a1 = endpoint(&mut p.a, QpType::Rc, AccessFlags::empty());
    let mut a2 = endpoint(&mut p.a, QpType::Rc, AccessFlags::empty());
    connect(&mut p, &a1, &b1, QpType::Rc, Mtu::Mtu1024, Retries::PATIENT);
    connect(&mut p, &a2, &b2, QpType::Rc, Mtu::Mtu1024, Retries::PATIENT);
    let pool = b1.mr;
    let s: Vec<u16> = (0..4)
        .map(|k| srq_recv(&mut p.b, &mut srq, &pool, k * 1024, 1024))
        .collect();
    let msgs = [pattern(100, 1), pattern(200, 2), pattern(300, 3)];
    for (k, m) in msgs.iter().enumerate() {
        let ep = if k == 1 { &mut a2 } else { &mut a1 };
        p.a.drv.write_mr(&ep.mr, 0, m);
        let sg = [sge(&ep.mr, 0, m.len() as u32)];
        post(&mut p.a, ep, &wr(k as u64, SendOp::Send, SIG, &sg));
        p.pump();
    }
    assert_eq!(cqes(&mut p.a, &mut a1).len(), 2);
    assert_eq!(cqes(&mut p.a, &mut a2).len(), 1);
    let got1 = cqes(&mut p.b, &mut b1);
    let got2 = cqes(&mut p.b, &mut b2);
    assert_eq!(
        summary(&got1),
        vec![ok(WqeOpcode::Send, s[0]), ok(WqeOpcode::Send, s[2])]
    );
    assert_eq!(summary(&got2), vec![ok(WqeOpcode::Send, s[1])]);
    for (cqe, qpn, len) in [
        (&got1[0], b1.qp.qpn, 100),
        (&got2[0], b2.qp.qpn, 200),
        (&got1[1], b1.qp.qpn, 300),
    ] {
        assert_eq!(cqe.flags(), CqeFlags::RECV | CqeFlags::SRQ);
        assert_eq!(cqe.qpn.get(), qpn);
        assert_eq!(cqe.byte_count.get(), len);
    }
    for (k, m) in msgs.iter().enumerate() {
        assert_eq!(p.b.drv.read_mr(&pool, k * 1024, m.len()), *m);
    }
    // The SRQ is in use.
    assert_eq!(
        p.b.drv
            .cmd_param(&mut p.b.dev, Opcode::Hw2SwSrq, srq.srqn, 0)
            .0,
        CmdStatus::ResourceBusy
    );
}

#[test]
fn srq_limit_event_fires_once() {
    let mut p = Pair::new();
    let mut srq = p.b.drv.create_srq(&mut p.b.dev, PD, 4, 0).unwrap();
    let b = srq_endpoint(&mut p.b, &srq);
    let mut a = endpoint(&mut p.a, QpType::Rc, AccessFlags::empty());
    connect(&mut p, &a, &b, QpType::Rc, Mtu::Mtu1024, Retries::PATIENT);
    let pool = b.mr;
    for k in 0..5 {
        srq_recv(&mut p.b, &mut srq, &pool, k * 64, 64);
    }
    assert_eq!(
        p.b.drv
            .cmd_param(&mut p.b.dev, Opcode::ArmSrq, srq.srqn, 3)
            .0,
        CmdStatus::Ok
    );
    p.b.events();
    let limit_events = |node: &mut Node| {
        node.events()
            .into_iter()
            .filter(|e| matches!(e, Event::SrqLimit { .. }))
            .collect::<Vec<_>>()
    };
    let sg = [sge(&a.mr, 0, 8)];
    let mut send = |p: &mut Pair| {
        post(&mut p.a, &mut a, &wr(1, SendOp::Send, SIG, &sg));
        p.pump();
    };
    // 5 posted: two taken leave 3, not below the limit.
    send(&mut p);
    send(&mut p);
    assert!(limit_events(&mut p.b).is_empty());
    // The third leaves 2 < 3: one event, and the SRQ is disarmed.
    send(&mut p);
    assert_eq!(
        limit_events(&mut p.b),
        vec![Event::SrqLimit { srqn: srq.srqn }]
    );
    let (status, out) =
        p.b.drv
            .cmd(&mut p.b.dev, Opcode::QuerySrq, 0, srq.srqn, &[], 64);
    assert_eq!(status, CmdStatus::Ok);
    let srqc = hca_prm::ctx::Srqc::read_from_bytes(&out).unwrap();
    assert_eq!(srqc.limit.get(), 0);
    assert_eq!(srqc.consumer.get(), 3);
    send(&mut p);
    assert!(limit_events(&mut p.b).is_empty(), "fires once");
}

// ----- 7. QP state effects --------------------------------------------------

#[test]
fn reset_and_destroy_keep_completions_already_written() {
    let (mut p, mut a, mut b) = rc_pair();
    let r0 = recv(&mut p.b, &mut b, 0, 64);
    let r1 = recv(&mut p.b, &mut b, 64, 64);
    let sg = [sge(&a.mr, 0, 16)];
    let i0 = post(&mut p.a, &mut a, &wr(1, SendOp::Send, SIG, &sg));
    let i1 = post(&mut p.a, &mut a, &wr(2, SendOp::Send, SIG, &sg));
    p.pump();
    assert_eq!(
        p.a.drv
            .modify_qp(&mut p.a.dev, &a.qp, &QpModify::to_state(QpState::Reset)),
        CmdStatus::Ok
    );
    assert_eq!(p.a.qp_state(a.qp.qpn), QpState::Reset);
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::Send, i0), ok(WqeOpcode::Send, i1)]
    );
    assert_eq!(
        p.b.drv
            .cmd_param(&mut p.b.dev, Opcode::Hw2SwQp, b.qp.qpn, 0)
            .0,
        CmdStatus::Ok
    );
    let got = cqes(&mut p.b, &mut b);
    assert_eq!(
        summary(&got),
        vec![ok(WqeOpcode::Send, r0), ok(WqeOpcode::Send, r1)]
    );
    assert!(got.iter().all(|c| c.qpn.get() == b.qp.qpn));
    // Destroyed: the QP is gone and its CQ is free.
    assert_eq!(
        p.b.drv.query_qp(&mut p.b.dev, b.qp.qpn).unwrap_err(),
        CmdStatus::BadResState
    );
    assert_eq!(
        p.b.drv
            .cmd_param(&mut p.b.dev, Opcode::Hw2SwCq, b.cq.cqn, 0)
            .0,
        CmdStatus::Ok
    );
}

#[test]
fn sqd_drains_raises_sq_drained_and_resumes() {
    let (mut p, mut a, mut b) = rc_pair_with(
        Mtu::Mtu1024,
        Retries {
            timeout: 8,
            retry: 7,
            rnr_retry: 7,
        },
    );
    let r0 = recv(&mut p.b, &mut b, 0, 64);
    let r1 = recv(&mut p.b, &mut b, 64, 64);
    let sg = [sge(&a.mr, 0, 16)];
    // The first send's ACK is lost, so it is still outstanding at SQD.
    p.filter = Some(drop_first_responses(1));
    let i0 = post(&mut p.a, &mut a, &wr(1, SendOp::Send, SIG, &sg));
    p.pump();
    p.a.events();
    let sqd = QpModify {
        state: Some(QpState::Sqd),
        en_sqd_async_notify: Some(true),
        ..QpModify::default()
    };
    assert_eq!(p.a.drv.modify_qp(&mut p.a.dev, &a.qp, &sqd), CmdStatus::Ok);
    assert_eq!(p.a.qp_state(a.qp.qpn), QpState::Sqd);
    // Posted in SQD: not started.
    let i1 = post(&mut p.a, &mut a, &wr(2, SendOp::Send, SIG, &sg));
    p.pump();
    let drained = |n: &mut Node| {
        n.events()
            .into_iter()
            .filter(|e| matches!(e, Event::SqDrained { .. }))
            .collect::<Vec<_>>()
    };
    assert!(
        drained(&mut p.a).is_empty(),
        "the first send is outstanding"
    );
    p.advance(10_000_000);
    assert_eq!(
        drained(&mut p.a),
        vec![Event::SqDrained {
            qpn: Qpn::new(a.qp.qpn).unwrap()
        }]
    );
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::Send, i0)]
    );
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b)),
        vec![ok(WqeOpcode::Send, r0)]
    );
    assert_eq!(p.a.qp_state(a.qp.qpn), QpState::Sqd);
    // SQD -> RTS: the second send goes.
    assert_eq!(
        p.a.drv
            .modify_qp(&mut p.a.dev, &a.qp, &QpModify::to_state(QpState::Rts)),
        CmdStatus::Ok
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::Send, i1)]
    );
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b)),
        vec![ok(WqeOpcode::Send, r1)]
    );
}

#[test]
fn cq_overflow_raises_cq_error_and_fails_the_qp() {
    let mut p = Pair::new();
    let mut a = endpoint_with(
        &mut p.a,
        QpType::Ud,
        1,
        QpcFlags::empty(),
        AccessFlags::empty(),
    );
    let b = endpoint(&mut p.b, QpType::Ud, AccessFlags::empty());
    ud_ready(&mut p.a, &a);
    ud_ready(&mut p.b, &b);
    p.a.events();
    let sg = [sge(&a.mr, 0, 16)];
    let bq = b.qp.qpn;
    let i0 = post_ud(&mut p.a, &mut a, SendOp::Send, &sg, IP_B, bq);
    let i1 = post_ud(&mut p.a, &mut a, SendOp::Send, &sg, IP_B, bq);
    post_ud(&mut p.a, &mut a, SendOp::Send, &sg, IP_B, bq);
    p.pump();
    assert_eq!(
        p.a.events()
            .into_iter()
            .filter(|e| matches!(e, Event::CqError { .. }))
            .collect::<Vec<_>>(),
        vec![Event::CqError { cqn: a.cq.cqn }]
    );
    assert_eq!(p.a.qp_state(a.qp.qpn), QpState::Err);
    let (status, out) =
        p.a.drv
            .cmd(&mut p.a.dev, Opcode::QueryCq, 0, a.cq.cqn, &[], 64);
    assert_eq!(status, CmdStatus::Ok);
    assert_eq!(Cqc::read_from_bytes(&out).unwrap().state, 4, "error");
    // What fitted is kept.
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::Send, i0), ok(WqeOpcode::Send, i1)]
    );
}

#[test]
fn hw2sw_cq_of_a_cq_in_use_is_busy() {
    let mut p = Pair::new();
    let a = endpoint(&mut p.a, QpType::Rc, AccessFlags::empty());
    let n = &mut p.a;
    assert_eq!(
        n.drv.cmd_param(&mut n.dev, Opcode::Hw2SwCq, a.cq.cqn, 0).0,
        CmdStatus::ResourceBusy
    );
    assert_eq!(
        n.drv.cmd_param(&mut n.dev, Opcode::Hw2SwQp, a.qp.qpn, 0).0,
        CmdStatus::Ok
    );
    assert_eq!(
        n.drv.cmd_param(&mut n.dev, Opcode::Hw2SwCq, a.cq.cqn, 0).0,
        CmdStatus::Ok
    );
}

#[test]
fn resize_cq_keeps_unpolled_completions_in_order() {
    let (mut p, mut a, b) = rc_pair();
    let sg = [sge(&a.mr, 0, 16)];
    let write = |p: &mut Pair, a: &mut Endpoint| {
        post(
            &mut p.a,
            a,
            &wr(
                0,
                SendOp::RdmaWrite {
                    remote: remote(&b.mr, 0),
                },
                SIG,
                &sg,
            ),
        )
    };
    let i: Vec<u16> = (0..3).map(|_| write(&mut p, &mut a)).collect();
    p.pump();
    assert_eq!(
        summary(&[p.a.drv.poll_cq(&mut a.cq).unwrap()]),
        vec![ok(WqeOpcode::RdmaWrite, i[0])]
    );
    assert_eq!(p.a.drv.resize_cq(&mut p.a.dev, &mut a.cq, 2), CmdStatus::Ok);
    assert_eq!(a.cq.log_entries(), 2);
    let j: Vec<u16> = (0..2).map(|_| write(&mut p, &mut a)).collect();
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        [i[1], i[2], j[0], j[1]]
            .iter()
            .map(|&x| ok(WqeOpcode::RdmaWrite, x))
            .collect::<Vec<_>>()
    );
    // Too small for what is outstanding: refused, the old ring goes on.
    let k: Vec<u16> = (0..3).map(|_| write(&mut p, &mut a)).collect();
    p.pump();
    assert_eq!(
        p.a.drv.resize_cq(&mut p.a.dev, &mut a.cq, 1),
        CmdStatus::ExceedLimit
    );
    assert_eq!(a.cq.log_entries(), 2);
    let l = write(&mut p, &mut a);
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        [k[0], k[1], k[2], l]
            .iter()
            .map(|&x| ok(WqeOpcode::RdmaWrite, x))
            .collect::<Vec<_>>()
    );
    assert_eq!(p.a.qp_state(a.qp.qpn), QpState::Rts);
}

// ----- 8. ports -------------------------------------------------------------

#[test]
fn link_down_and_up_raise_port_change_and_gate_delivery() {
    let (mut p, mut a, mut b) = rc_pair_with(
        Mtu::Mtu1024,
        Retries {
            timeout: 10,
            retry: 7,
            rnr_retry: 7,
        },
    );
    p.b.events();
    p.b.dev.set_link(1, false);
    let port = PortNum::new(1).unwrap();
    assert_eq!(
        p.b.events(),
        vec![Event::PortChange {
            port,
            active: false
        }]
    );
    assert_eq!(query_port(&mut p.b).state, 1, "DOWN");
    let r0 = recv(&mut p.b, &mut b, 0, 64);
    let data = pattern(32, 120);
    p.a.drv.write_mr(&a.mr, 0, &data);
    let sg = [sge(&a.mr, 0, 32)];
    let i0 = post(&mut p.a, &mut a, &wr(1, SendOp::Send, SIG, &sg));
    p.pump();
    assert!(
        cqes(&mut p.b, &mut b).is_empty(),
        "not delivered while down"
    );
    assert_eq!(p.b.dev.port_counters(1).unwrap().rx_discards, 1);
    p.b.dev.set_link(1, true);
    assert_eq!(p.b.events(), vec![Event::PortChange { port, active: true }]);
    assert_eq!(query_port(&mut p.b).state, 4, "ACTIVE");
    p.advance(100_000_000);
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::Send, i0)]
    );
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b)),
        vec![ok(WqeOpcode::Send, r0)]
    );
    assert_eq!(p.b.drv.read_mr(&b.mr, 0, 32), data);
}

fn set_pkey(node: &mut Node, index: u32, pkey: u16) {
    assert_eq!(
        node.drv
            .cmd_param(
                &mut node.dev,
                Opcode::SetPkey,
                1 | index << 8,
                u64::from(pkey)
            )
            .0,
        CmdStatus::Ok
    );
}

#[test]
fn pkey_mismatch_drops_counts_and_traps() {
    let (mut p, mut a, mut b) = ud_pair();
    set_pkey(&mut p.b, 0, 0x8001);
    p.b.events();
    recv(&mut p.b, &mut b, 0, 256);
    let sg = [sge(&a.mr, 0, 16)];
    let bq = b.qp.qpn;
    let i0 = post_ud(&mut p.a, &mut a, SendOp::Send, &sg, IP_B, bq);
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::Send, i0)]
    );
    assert!(cqes(&mut p.b, &mut b).is_empty(), "dropped");
    let info = query_port(&mut p.b);
    assert_eq!(info.pkey_violations.get(), 1);
    assert_eq!(info.rx_discards.get(), 1);
    let port = PortNum::new(1).unwrap();
    assert_eq!(p.b.events(), vec![Event::PkeyViolation { port }]);
    // Matching keys again: delivered.
    set_pkey(&mut p.b, 0, 0xFFFF);
    post_ud(&mut p.a, &mut a, SendOp::Send, &sg, IP_B, bq);
    p.pump();
    assert_eq!(cqes(&mut p.b, &mut b).len(), 1);
}

const GROUP: [u8; 4] = [239, 1, 2, 3];

fn mcg(node: &mut Node, attach: bool, qpn: u32) -> CmdStatus {
    let op = if attach {
        Opcode::AttachMcg
    } else {
        Opcode::DetachMcg
    };
    let gid = Gid::from_ipv4(GROUP);
    node.drv.cmd(&mut node.dev, op, 0, qpn, gid.as_bytes(), 0).0
}

#[test]
fn multicast_reaches_every_attached_qp() {
    let (mut p, mut a, mut b) = ud_pair();
    let mut b2 = endpoint(&mut p.b, QpType::Ud, AccessFlags::empty());
    ud_ready(&mut p.b, &b2);
    assert_eq!(mcg(&mut p.b, true, b.qp.qpn), CmdStatus::Ok);
    assert_eq!(mcg(&mut p.b, true, b2.qp.qpn), CmdStatus::Ok);
    assert_eq!(mcg(&mut p.b, true, b2.qp.qpn), CmdStatus::BadResState);
    assert_eq!(p.b.dev.multicast_macs(1), vec![[0x01, 0x00, 0x5e, 1, 2, 3]]);
    let data = pattern(48, 130);
    p.a.drv.write_mr(&a.mr, 0, &data);
    let sg = [sge(&a.mr, 0, 48)];
    let r0 = recv(&mut p.b, &mut b, 0, 40 + 48);
    let s0 = recv(&mut p.b, &mut b2, 0, 40 + 48);
    let i0 = post_ud(&mut p.a, &mut a, SendOp::Send, &sg, GROUP, 0xFF_FFFF);
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::Send, i0)]
    );
    for (ep, r) in [(&mut b, r0), (&mut b2, s0)] {
        let got = cqes(&mut p.b, ep);
        assert_eq!(summary(&got), vec![ok(WqeOpcode::Send, r)]);
        assert_eq!(got[0].src_qp.get(), a.qp.qpn);
        assert_eq!(got[0].byte_count.get(), 40 + 48);
        assert_eq!(p.b.drv.read_mr(&ep.mr, 40, 48), data);
        // The GRH carries the group as the IPv4 destination.
        assert_eq!(p.b.drv.read_mr(&ep.mr, 36, 4), GROUP);
    }
    // Detach one: only the other receives.
    assert_eq!(mcg(&mut p.b, false, b2.qp.qpn), CmdStatus::Ok);
    recv(&mut p.b, &mut b, 128, 40 + 48);
    recv(&mut p.b, &mut b2, 128, 40 + 48);
    post_ud(&mut p.a, &mut a, SendOp::Send, &sg, GROUP, 0xFF_FFFF);
    p.pump();
    assert_eq!(cqes(&mut p.b, &mut b).len(), 1);
    assert!(cqes(&mut p.b, &mut b2).is_empty());
}

#[test]
fn multicast_honours_the_pkey_check() {
    // PRM 11: "P_Key checked on every packet"; multicast is no exception.
    let (mut p, mut a, mut b) = ud_pair();
    assert_eq!(mcg(&mut p.b, true, b.qp.qpn), CmdStatus::Ok);
    set_pkey(&mut p.b, 0, 0x8001);
    p.b.events();
    recv(&mut p.b, &mut b, 0, 256);
    let sg = [sge(&a.mr, 0, 16)];
    post_ud(&mut p.a, &mut a, SendOp::Send, &sg, GROUP, 0xFF_FFFF);
    p.pump();
    assert!(cqes(&mut p.b, &mut b).is_empty(), "dropped");
    let info = query_port(&mut p.b);
    assert_eq!(info.pkey_violations.get(), 1);
    assert_eq!(info.rx_discards.get(), 1);
    let port = PortNum::new(1).unwrap();
    assert_eq!(p.b.events(), vec![Event::PkeyViolation { port }]);
}

// ----- 9. commands ----------------------------------------------------------

#[test]
fn bad_commands_fail_with_the_right_status() {
    let mut n = Node::new(0x0200_00ff_fe00_0c00, [10, 0, 0, 3], 0x30_0000_0000);
    let before = n.dev.counters().bad_commands;
    let mut failures = 0;
    let mut expect = |n: &mut Node, got: CmdStatus, want: CmdStatus, what: &str| {
        assert_eq!(got, want, "{what}");
        failures += 1;
        let _ = n;
    };
    // Unknown opcode; a known opcode with an op_mod it does not take.
    let e = CmdEntry {
        opcode: Le16::new(0x7FF),
        ..CmdEntry::default()
    };
    let got = n.drv.cmd_raw(&mut n.dev, e).0;
    expect(&mut n, got, CmdStatus::BadOpcode, "unknown opcode");
    let e = CmdEntry {
        opcode: Le16::new(Opcode::Nop.code()),
        op_mod: Le16::new(1),
        ..CmdEntry::default()
    };
    let got = n.drv.cmd_raw(&mut n.dev, e).0;
    expect(&mut n, got, CmdStatus::BadOpcode, "op_mod");
    // Object numbers outside their tables.
    let got = n.drv.query_qp(&mut n.dev, 1 << 20).unwrap_err();
    expect(&mut n, got, CmdStatus::BadIndex, "QPN out of range");
    let got = n
        .drv
        .cmd(&mut n.dev, Opcode::QueryCq, 0, 1 << 20, &[], 64)
        .0;
    expect(&mut n, got, CmdStatus::BadIndex, "CQN out of range");
    // Create twice, destroy a free object.
    let cq = n.drv.create_cq(&mut n.dev, 4).unwrap();
    let got = n
        .drv
        .cmd(
            &mut n.dev,
            Opcode::Sw2HwCq,
            0,
            cq.cqn,
            Cqc::default().as_bytes(),
            0,
        )
        .0;
    expect(&mut n, got, CmdStatus::BadResState, "create twice");
    let got = n.drv.cmd_param(&mut n.dev, Opcode::Hw2SwQp, 200, 0).0;
    expect(&mut n, got, CmdStatus::BadResState, "destroy a free QP");
    // Illegal QP transitions: RESET -> RTS, and INIT -> RTR without its
    // required attributes.
    let qp = n
        .drv
        .create_qp(&mut n.dev, QpType::Rc, 1, PD, &cq, &cq, None, (4, 4))
        .unwrap();
    let got = n
        .drv
        .modify_qp(&mut n.dev, &qp, &bring_up::to_rts(QpType::Rc, 0, 14, 7, 7));
    expect(&mut n, got, CmdStatus::BadQpState, "RESET -> RTS");
    assert_eq!(n.qp_state(qp.qpn), QpState::Reset);
    assert_eq!(
        n.drv.modify_qp(
            &mut n.dev,
            &qp,
            &bring_up::to_init(QpType::Rc, ALL_REMOTE, 0)
        ),
        CmdStatus::Ok
    );
    let got = n
        .drv
        .modify_qp(&mut n.dev, &qp, &QpModify::to_state(QpState::Rtr));
    expect(
        &mut n,
        got,
        CmdStatus::BadQpState,
        "INIT -> RTR, no attributes",
    );
    assert_eq!(n.qp_state(qp.qpn), QpState::Init);
    // Reserved bytes: in the command entry and in a context.
    let e = CmdEntry {
        opcode: Le16::new(Opcode::Nop.code()),
        reserved_at_0x7: 1,
        ..CmdEntry::default()
    };
    let got = n.drv.cmd_raw(&mut n.dev, e).0;
    expect(
        &mut n,
        got,
        CmdStatus::BadParam,
        "reserved byte in the entry",
    );
    let cqc = Cqc {
        reserved_at_0x1: [0, 1, 0],
        ..Cqc::default()
    };
    let got = n
        .drv
        .cmd(
            &mut n.dev,
            Opcode::Sw2HwCq,
            0,
            cq.cqn + 1,
            cqc.as_bytes(),
            0,
        )
        .0;
    expect(&mut n, got, CmdStatus::BadParam, "reserved byte in a CQC");
    // Mailboxes outside any DMA mapping.
    let e = CmdEntry {
        opcode: Le16::new(Opcode::QueryDevCap.code()),
        out_param: Le64::new(0x1000),
        out_len: Le32::new(256),
        ..CmdEntry::default()
    };
    let got = n.drv.cmd_raw(&mut n.dev, e).0;
    expect(
        &mut n,
        got,
        CmdStatus::BadMailbox,
        "unmapped output mailbox",
    );
    let e = CmdEntry {
        opcode: Le16::new(Opcode::Sw2HwCq.code()),
        in_mod: Le32::new(cq.cqn + 1),
        in_param: Le64::new(0x2000),
        in_len: Le32::new(64),
        ..CmdEntry::default()
    };
    let got = n.drv.cmd_raw(&mut n.dev, e).0;
    expect(&mut n, got, CmdStatus::BadMailbox, "unmapped input mailbox");
    let e = CmdEntry {
        opcode: Le16::new(Opcode::Sw2HwCq.code()),
        in_mod: Le32::new(cq.cqn + 1),
        in_param: Le64::new(n.drv.mailbox_in_bus()),
        in_len: Le32::new(8192),
        ..CmdEntry::default()
    };
    let got = n.drv.cmd_raw(&mut n.dev, e).0;
    expect(&mut n, got, CmdStatus::BadMailbox, "mailbox over 4 KiB");
    assert_eq!(n.dev.counters().bad_commands - before, failures);
    assert_eq!(
        n.dev.mmio_read32(hca_prm::regs::offset::BAD_COMMANDS),
        n.dev.counters().bad_commands
    );
    assert!(!n.dev.is_fatal());
    // The device still works.
    assert_eq!(
        n.drv.cmd_param(&mut n.dev, Opcode::Nop, 0, 0).0,
        CmdStatus::Ok
    );
}

#[test]
fn dma_fault_on_an_unmapped_ring_is_counted_not_fatal() {
    let (mut p, mut a, _b) = rc_pair();
    assert_eq!(p.a.dev.counters().dma_faults, 0);
    assert!(p.a.drv.mem.unmap(a.qp.sq_buf().bus));
    let sg = [sge(&a.mr, 0, 16)];
    let i0 = post(&mut p.a, &mut a, &wr(1, SendOp::Send, SIG, &sg));
    p.pump();
    let faults = p.a.dev.counters().dma_faults;
    assert!(faults >= 1, "counted");
    assert_eq!(
        p.a.dev.mmio_read32(hca_prm::regs::offset::DMA_FAULTS),
        faults
    );
    assert!(!p.a.dev.is_fatal());
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![c(WqeOpcode::Nop, WcStatus::LocQpOpErr, i0)]
    );
    assert_eq!(p.a.qp_state(a.qp.qpn), QpState::Err);
    assert_eq!(p.a.dev.port_counters(1).unwrap().tx_packets, 0);
}

// ----- more of the contract: events, wrap-around, scatter/gather ------------

/// Moves an RC endpoint through INIT and RTR (and RTS when `rts`) towards
/// `peer`, with fixed PSNs: this side sends from `psn`, expects `peer_psn`.
#[allow(clippy::too_many_arguments, reason = "a connection has this many")]
fn bring_rc(
    node: &mut Node,
    ep: &Endpoint,
    peer_ip: [u8; 4],
    peer_qpn: u32,
    psn: u32,
    peer_psn: u32,
    mtu: Mtu,
    rts: bool,
) {
    let q = QpType::Rc;
    let mut steps = vec![
        bring_up::to_init(q, ALL_REMOTE, 0),
        bring_up::to_rtr(q, peer_ip, peer_qpn, peer_psn, mtu),
    ];
    if rts {
        steps.push(bring_up::to_rts(q, psn, 14, 7, 7));
    }
    for m in steps {
        assert_eq!(node.drv.modify_qp(&mut node.dev, &ep.qp, &m), CmdStatus::Ok);
    }
}

fn qp_events(node: &mut Node) -> Vec<Event> {
    node.events()
        .into_iter()
        .filter(|e| {
            !matches!(
                e,
                Event::PortChange { .. } | Event::Completion { .. } | Event::CmdCompletion { .. }
            )
        })
        .collect()
}

#[test]
fn comm_est_when_a_qp_in_rtr_receives_its_first_packet() {
    // PRM 8.2 COMM_EST (IBA 11.6.3.1 "Communication Established": a QP in
    // RTR received its first packet).
    let mut p = Pair::new();
    let mut a = endpoint(&mut p.a, QpType::Rc, AccessFlags::empty());
    let mut b = endpoint(&mut p.b, QpType::Rc, AccessFlags::empty());
    bring_rc(&mut p.a, &a, IP_B, b.qp.qpn, 100, 5000, Mtu::Mtu1024, true);
    bring_rc(&mut p.b, &b, IP_A, a.qp.qpn, 5000, 100, Mtu::Mtu1024, false);
    p.b.events();
    let r0 = recv(&mut p.b, &mut b, 0, 64);
    let r1 = recv(&mut p.b, &mut b, 64, 64);
    let sg = [sge(&a.mr, 0, 16)];
    let i0 = post(&mut p.a, &mut a, &wr(1, SendOp::Send, SIG, &sg));
    let i1 = post(&mut p.a, &mut a, &wr(2, SendOp::Send, SIG, &sg));
    p.pump();
    assert_eq!(
        qp_events(&mut p.b),
        vec![Event::CommEst {
            qpn: Qpn::new(b.qp.qpn).unwrap()
        }],
        "once, for the first packet"
    );
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::Send, i0), ok(WqeOpcode::Send, i1)]
    );
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b)),
        vec![ok(WqeOpcode::Send, r0), ok(WqeOpcode::Send, r1)]
    );
    assert!(qp_events(&mut p.a).is_empty(), "A was in RTS");
}

#[test]
fn responder_errors_without_a_receive_wqe_raise_affiliated_events() {
    // IBA 11.6.3.1 / responder class C: an error the responder cannot
    // report in a CQE (no receive WQE in use) is reported with an
    // affiliated event: Local Access Violation WQ Error for an R_Key
    // violation, Invalid Request Local WQ Error for an invalid request.
    let (mut p, mut a, b) = rc_pair();
    p.b.events();
    let sg = [sge(&a.mr, 0, 16)];
    let bad = RemoteAddr {
        addr: b.mr.va,
        rkey: RKey::new(b.mr.rkey.get() ^ 0x10),
    };
    post(
        &mut p.a,
        &mut a,
        &wr(1, SendOp::RdmaWrite { remote: bad }, SIG, &sg),
    );
    p.pump();
    let qpn = Qpn::new(b.qp.qpn).unwrap();
    assert_eq!(qp_events(&mut p.b), vec![Event::WqAccessError { qpn }]);
    assert_eq!(p.b.qp_state(b.qp.qpn), QpState::Err);

    let (mut p, mut a, b) = rc_pair();
    p.b.events();
    let sg8 = [sge(&a.mr, 0, 8)];
    post(
        &mut p.a,
        &mut a,
        &wr(
            1,
            SendOp::FetchAdd {
                remote: remote(&b.mr, 3),
                add: 1,
            },
            SIG,
            &sg8,
        ),
    );
    p.pump();
    let qpn = Qpn::new(b.qp.qpn).unwrap();
    assert_eq!(qp_events(&mut p.b), vec![Event::WqInvalidRequest { qpn }]);

    // With a receive WQE in use the CQE reports it, and no event is due.
    let (mut p, mut a, mut b) = rc_pair();
    p.b.events();
    let r0 = recv(&mut p.b, &mut b, 0, 8);
    post(&mut p.a, &mut a, &wr(1, SendOp::Send, SIG, &sg));
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b)),
        vec![c(WqeOpcode::Send, WcStatus::LocLenErr, r0)]
    );
    assert!(qp_events(&mut p.b).is_empty());
}

#[test]
fn cq_overflow_reports_the_qp_that_could_not_complete() {
    // IBA 11.6.3.1: a work queue that cannot post its completion because
    // its CQ is in error gets a Local Work Queue Catastrophic Error
    // (PRM 8.2 QP_FATAL); otherwise nothing tells its owner it went to ERR.
    let mut p = Pair::new();
    let mut a = endpoint_with(
        &mut p.a,
        QpType::Ud,
        1,
        QpcFlags::empty(),
        AccessFlags::empty(),
    );
    let b = endpoint(&mut p.b, QpType::Ud, AccessFlags::empty());
    ud_ready(&mut p.a, &a);
    ud_ready(&mut p.b, &b);
    p.a.events();
    let sg = [sge(&a.mr, 0, 16)];
    for _ in 0..3 {
        post_ud(&mut p.a, &mut a, SendOp::Send, &sg, IP_B, b.qp.qpn);
    }
    p.pump();
    let qpn = Qpn::new(a.qp.qpn).unwrap();
    assert_eq!(
        qp_events(&mut p.a),
        vec![Event::CqError { cqn: a.cq.cqn }, Event::QpFatal { qpn }]
    );
}

#[test]
fn srq_last_wqe_when_an_srq_qp_is_moved_to_err() {
    // IBA 11.6.3.1 "Last WQE Reached": a QP on an SRQ that enters ERR, by
    // an error or by MODIFY_QP, will take no more WQEs from the SRQ.
    let mut p = Pair::new();
    let srq = p.b.drv.create_srq(&mut p.b.dev, PD, 4, 0).unwrap();
    let b = srq_endpoint(&mut p.b, &srq);
    let a = endpoint(&mut p.a, QpType::Rc, AccessFlags::empty());
    connect(&mut p, &a, &b, QpType::Rc, Mtu::Mtu1024, Retries::PATIENT);
    p.b.events();
    assert_eq!(
        p.b.drv
            .modify_qp(&mut p.b.dev, &b.qp, &QpModify::to_state(QpState::Err)),
        CmdStatus::Ok
    );
    let qpn = Qpn::new(b.qp.qpn).unwrap();
    assert_eq!(qp_events(&mut p.b), vec![Event::SrqLastWqe { qpn }]);
}

#[test]
fn modify_to_err_flushes_posted_work() {
    let (mut p, mut a, _b) = rc_pair();
    let r0 = recv(&mut p.a, &mut a, 0, 64);
    let r1 = recv(&mut p.a, &mut a, 64, 64);
    p.filter = Some(Box::new(|_, _| false));
    let sg = [sge(&a.mr, 0, 16)];
    let i0 = post(&mut p.a, &mut a, &wr(1, SendOp::Send, NONE, &sg));
    p.pump();
    assert_eq!(
        p.a.drv
            .modify_qp(&mut p.a.dev, &a.qp, &QpModify::to_state(QpState::Err)),
        CmdStatus::Ok
    );
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![
            c(WqeOpcode::Send, WcStatus::WrFlushErr, i0),
            c(WqeOpcode::Send, WcStatus::WrFlushErr, r0),
            c(WqeOpcode::Send, WcStatus::WrFlushErr, r1)
        ]
    );
}

#[test]
fn ud_messages_are_limited_by_the_port_mtu() {
    // A UD QP has no path MTU of its own: a message must fit one packet of
    // the port's MTU (PRM 11, IBA 9.8.2); here the ports run 512 bytes.
    let node = |guid, ip, bus| {
        let mut cfg = sim_hca::device::DeviceConfig::with_ports(guid, &[ip]);
        cfg.ports[0].max_mtu = Mtu::Mtu512;
        Node::with_config(cfg, bus)
    };
    let mut p = Pair::of(
        node(0x0200_00ff_fe00_0a00, IP_A, 0x10_0000_0000),
        node(0x0200_00ff_fe00_0b00, IP_B, 0x20_0000_0000),
    );
    assert_eq!(query_port(&mut p.a).active_mtu, Mtu::Mtu512.code());
    let mut a = endpoint(&mut p.a, QpType::Ud, AccessFlags::empty());
    let mut b = endpoint(&mut p.b, QpType::Ud, AccessFlags::empty());
    ud_ready(&mut p.a, &a);
    ud_ready(&mut p.b, &b);
    let r0 = recv(&mut p.b, &mut b, 0, 40 + 1024);
    let fits = [sge(&a.mr, 0, 512)];
    let over = [sge(&a.mr, 0, 513)];
    let i0 = post_ud(&mut p.a, &mut a, SendOp::Send, &fits, IP_B, b.qp.qpn);
    p.pump();
    let i1 = post_ud(&mut p.a, &mut a, SendOp::Send, &over, IP_B, b.qp.qpn);
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![
            ok(WqeOpcode::Send, i0),
            c(WqeOpcode::Send, WcStatus::LocLenErr, i1)
        ]
    );
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b)),
        vec![ok(WqeOpcode::Send, r0)]
    );
}

#[test]
fn rc_psns_wrap_around() {
    let mut p = Pair::new();
    let mut a = endpoint(&mut p.a, QpType::Rc, AccessFlags::empty());
    let mut b = endpoint(&mut p.b, QpType::Rc, AccessFlags::empty());
    let (pa, pb) = (0xFF_FFFD, 0xFF_FFFF);
    bring_rc(&mut p.a, &a, IP_B, b.qp.qpn, pa, pb, Mtu::Mtu1024, true);
    bring_rc(&mut p.b, &b, IP_A, a.qp.qpn, pb, pa, Mtu::Mtu1024, true);
    let data = pattern(5000, 140);
    p.a.drv.write_mr(&a.mr, 0, &data);
    p.b.drv.write_mr(&b.mr, 32_768, &data);
    let r0 = recv(&mut p.b, &mut b, 0, 8192);
    // Lose the third packet once so the retransmission crosses the wrap.
    let mut seen = 0;
    p.filter = Some(Box::new(move |to_b, _| {
        seen += usize::from(to_b);
        !(to_b && seen == 3)
    }));
    let sg = [sge(&a.mr, 0, 5000)];
    let sg_r = [sge(&a.mr, 8192, 5000)];
    let i0 = post(&mut p.a, &mut a, &wr(1, SendOp::Send, SIG, &sg));
    let i1 = post(
        &mut p.a,
        &mut a,
        &wr(
            2,
            SendOp::RdmaRead {
                remote: remote(&b.mr, 32_768),
            },
            SIG,
            &sg_r,
        ),
    );
    p.advance(1_000_000_000);
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::Send, i0), ok(WqeOpcode::RdmaRead, i1)]
    );
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b)),
        vec![ok(WqeOpcode::Send, r0)]
    );
    assert_eq!(p.b.drv.read_mr(&b.mr, 0, 5000), data);
    assert_eq!(p.a.drv.read_mr(&a.mr, 8192, 5000), data);
    let qpc = p.a.drv.query_qp(&mut p.a.dev, a.qp.qpn).unwrap();
    assert_eq!(qpc.state, QpState::Rts.code());
}

#[test]
fn lost_read_response_in_the_middle_is_requested_again() {
    let (mut p, mut a, b) = rc_pair_with(
        Mtu::Mtu1024,
        Retries {
            timeout: 8,
            retry: 7,
            rnr_retry: 7,
        },
    );
    let data = pattern(4000, 150);
    p.b.drv.write_mr(&b.mr, 0, &data);
    let mut seen = 0;
    p.filter = Some(Box::new(move |to_b, _| {
        seen += usize::from(!to_b);
        to_b || seen != 2
    }));
    let sg = [sge(&a.mr, 0, 4000)];
    let i0 = post(
        &mut p.a,
        &mut a,
        &wr(
            1,
            SendOp::RdmaRead {
                remote: remote(&b.mr, 0),
            },
            SIG,
            &sg,
        ),
    );
    p.advance(100_000_000);
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::RdmaRead, i0)]
    );
    assert_eq!(p.a.drv.read_mr(&a.mr, 0, 4000), data);
}

#[test]
fn uc_lost_packet_drops_only_its_message() {
    let (mut p, mut a, mut b) = uc_pair();
    let data = pattern(3000, 160);
    p.a.drv.write_mr(&a.mr, 0, &data);
    let r0 = recv(&mut p.b, &mut b, 0, 4096);
    recv(&mut p.b, &mut b, 4096, 4096);
    let mut seen = 0;
    p.filter = Some(Box::new(move |to_b, _| {
        seen += usize::from(to_b);
        !(to_b && seen == 2)
    }));
    let sg = [sge(&a.mr, 0, 3000)];
    let i0 = post(&mut p.a, &mut a, &wr(1, SendOp::Send, SIG, &sg));
    let i1 = post(&mut p.a, &mut a, &wr(2, SendOp::Send, SIG, &sg));
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::Send, i0), ok(WqeOpcode::Send, i1)]
    );
    // The first message is lost; the second lands in the first receive WQE.
    let got = cqes(&mut p.b, &mut b);
    assert_eq!(summary(&got), vec![ok(WqeOpcode::Send, r0)]);
    assert_eq!(got[0].byte_count.get(), 3000);
    assert_eq!(p.b.drv.read_mr(&b.mr, 0, 3000), data);
}

#[test]
fn rc_gather_and_scatter_across_sges() {
    let (mut p, mut a, mut b) = rc_pair();
    let data = pattern(2000, 170);
    // Gather from three pieces of A's region, out of order in memory.
    p.a.drv.write_mr(&a.mr, 10_000, &data[..700]);
    p.a.drv.write_mr(&a.mr, 2_000, &data[700..1500]);
    p.a.drv.write_mr(&a.mr, 30_000, &data[1500..]);
    let gather = [
        sge(&a.mr, 10_000, 700),
        sge(&a.mr, 2_000, 800),
        Sge::new(0, 0, LKey::new(0)),
        sge(&a.mr, 30_000, 500),
    ];
    // Scatter into three pieces of B's.
    let index = b.qp.rq_producer as u16;
    let scatter = [
        sge(&b.mr, 40_000, 100),
        sge(&b.mr, 0, 1000),
        sge(&b.mr, 20_000, 1000),
    ];
    p.b.drv.post_recv(&mut b.qp, 1, &scatter);
    let i0 = post(&mut p.a, &mut a, &wr(1, SendOp::Send, SIG, &gather));
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::Send, i0)]
    );
    let got = cqes(&mut p.b, &mut b);
    assert_eq!(summary(&got), vec![ok(WqeOpcode::Send, index)]);
    assert_eq!(got[0].byte_count.get(), 2000);
    assert_eq!(p.b.drv.read_mr(&b.mr, 40_000, 100), data[..100]);
    assert_eq!(p.b.drv.read_mr(&b.mr, 0, 1000), data[100..1100]);
    assert_eq!(p.b.drv.read_mr(&b.mr, 20_000, 900), data[1100..]);
    assert_eq!(p.b.drv.read_mr(&b.mr, 20_900, 100), vec![0; 100]);
    // A read scatters its response the same way.
    let back = [sge(&a.mr, 50_000, 1200), sge(&a.mr, 45_000, 800)];
    let i1 = post(
        &mut p.a,
        &mut a,
        &wr(
            2,
            SendOp::RdmaRead {
                remote: remote(&b.mr, 0),
            },
            SIG,
            &back,
        ),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::RdmaRead, i1)]
    );
    let mut expect = data[100..1100].to_vec();
    expect.extend(p.b.drv.read_mr(&b.mr, 1000, 1000));
    assert_eq!(p.a.drv.read_mr(&a.mr, 50_000, 1200), expect[..1200]);
    assert_eq!(p.a.drv.read_mr(&a.mr, 45_000, 800), expect[1200..]);
}

#[test]
fn rings_and_phases_wrap_around() {
    // 16-entry CQs, 64-block send rings, 64-entry receive rings: 150
    // two-block inline sends wrap every ring several times.
    let mut p = Pair::new();
    let mut a = endpoint_with(
        &mut p.a,
        QpType::Rc,
        4,
        QpcFlags::empty(),
        AccessFlags::empty(),
    );
    let mut b = endpoint_with(
        &mut p.b,
        QpType::Rc,
        4,
        QpcFlags::empty(),
        AccessFlags::empty(),
    );
    connect(&mut p, &a, &b, QpType::Rc, Mtu::Mtu1024, Retries::PATIENT);
    for k in 0..150u32 {
        let msg = pattern(100, k as u8);
        let r = recv(&mut p.b, &mut b, u64::from(k % 8) * 128, 128);
        let g = [Sge::new(0, 100, LKey::new(0))];
        let i = post_inline(
            &mut p.a,
            &mut a,
            &wr(u64::from(k), SendOp::Send, SIG | SendFlags::INLINE, &g),
            &msg,
        );
        p.pump();
        assert_eq!(
            summary(&cqes(&mut p.a, &mut a)),
            vec![ok(WqeOpcode::Send, i)]
        );
        assert_eq!(
            summary(&cqes(&mut p.b, &mut b)),
            vec![ok(WqeOpcode::Send, r)]
        );
        assert_eq!(
            p.b.drv.read_mr(&b.mr, u64::from(k % 8) as usize * 128, 100),
            msg
        );
    }
    assert_eq!(a.qp.sq_producer, 300);
}

#[test]
fn cq_arming_raises_completion_events() {
    let (mut p, mut a, mut b) = rc_pair();
    p.b.events();
    let completions = |n: &mut Node| {
        n.events()
            .into_iter()
            .filter(|e| matches!(e, Event::Completion { .. }))
            .collect::<Vec<_>>()
    };
    let cq_event = vec![Event::Completion { cqn: b.cq.cqn }];
    let sg = [sge(&a.mr, 0, 8)];
    for _ in 0..3 {
        recv(&mut p.b, &mut b, 0, 64);
    }
    // Armed for solicited: a plain send does not fire, a solicited one does.
    p.b.drv
        .arm_cq(&mut p.b.dev, &b.cq, hca_prm::doorbell::CqArm::Solicited);
    post(&mut p.a, &mut a, &wr(1, SendOp::Send, SIG, &sg));
    p.pump();
    assert!(completions(&mut p.b).is_empty());
    post(
        &mut p.a,
        &mut a,
        &wr(2, SendOp::Send, SIG | SendFlags::SOLICITED, &sg),
    );
    p.pump();
    assert_eq!(completions(&mut p.b), cq_event);
    assert_eq!(cqes(&mut p.b, &mut b).len(), 2);
    // Armed for next: any completion fires, once.
    p.b.drv
        .arm_cq(&mut p.b.dev, &b.cq, hca_prm::doorbell::CqArm::Next);
    post(&mut p.a, &mut a, &wr(3, SendOp::Send, SIG, &sg));
    p.pump();
    assert_eq!(completions(&mut p.b), cq_event);
    // Arming with completions already past the consumer fires at once.
    p.b.drv
        .arm_cq(&mut p.b.dev, &b.cq, hca_prm::doorbell::CqArm::Next);
    assert_eq!(completions(&mut p.b), cq_event);
    assert_eq!(cqes(&mut p.b, &mut b).len(), 1);
    cqes(&mut p.a, &mut a);
}

#[test]
fn local_invalidate_of_a_region_revokes_local_and_remote_access() {
    let (mut p, mut a, b) = rc_pair();
    let scratch = reg(
        &mut p.a,
        4096,
        PD,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
    );
    let i0 = post(
        &mut p.a,
        &mut a,
        &wr(1, SendOp::LocalInvalidate { rkey: scratch.rkey }, SIG, &[]),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::LocalInv, i0)]
    );
    assert_eq!(query_mpt(&mut p.a, scratch.index).unwrap().state, 0);
    let sg = [sge(&scratch, 0, 16)];
    let i1 = post(
        &mut p.a,
        &mut a,
        &wr(
            2,
            SendOp::RdmaWrite {
                remote: remote(&b.mr, 0),
            },
            SIG,
            &sg,
        ),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![c(WqeOpcode::RdmaWrite, WcStatus::LocProtErr, i1)]
    );
}

#[test]
fn ud_message_up_to_the_port_mtu_arrives_whole() {
    // The port MTU (4096) bounds a UD message, not the path MTU field a UD
    // QP never sets: a 4096-byte datagram is one packet and arrives whole.
    let (mut p, mut a, mut b) = ud_pair();
    let mtu = Mtu::from_code(query_port(&mut p.a).active_mtu)
        .unwrap()
        .bytes();
    let data = pattern(mtu as usize, 180);
    p.a.drv.write_mr(&a.mr, 0, &data);
    let r0 = recv(&mut p.b, &mut b, 0, 40 + mtu);
    let sg = [sge(&a.mr, 0, mtu)];
    let i0 = post_ud(&mut p.a, &mut a, SendOp::Send, &sg, IP_B, b.qp.qpn);
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::Send, i0)]
    );
    let got = cqes(&mut p.b, &mut b);
    assert_eq!(summary(&got), vec![ok(WqeOpcode::Send, r0)]);
    assert_eq!(got[0].byte_count.get(), 40 + mtu);
    assert_eq!(p.b.drv.read_mr(&b.mr, 40, mtu as usize), data);
}

#[test]
fn rnr_on_a_multi_packet_send_waits_the_rnr_timer() {
    // With rnr_retry 1 the requester may retry once, after the RNR timer.
    // The rest of the RNR-NAKed message must not draw a PSN sequence NAK
    // that triggers an early retransmission (IBA: after a NAK the responder
    // returns no other NAK until a request with the expected PSN).
    let (mut p, mut a, mut b) = rc_pair_with(
        Mtu::Mtu1024,
        Retries {
            timeout: 14,
            retry: 7,
            rnr_retry: 1,
        },
    );
    let data = pattern(3000, 190);
    p.a.drv.write_mr(&a.mr, 0, &data);
    let sg = [sge(&a.mr, 0, 3000)];
    let i0 = post(&mut p.a, &mut a, &wr(1, SendOp::Send, SIG, &sg));
    p.pump();
    assert!(
        cqes(&mut p.a, &mut a).is_empty(),
        "waiting out the RNR timer"
    );
    assert_eq!(p.a.dev.port_counters(1).unwrap().tx_packets, 3);
    assert_eq!(
        p.b.dev.port_counters(1).unwrap().tx_packets,
        1,
        "one RNR NAK"
    );
    let r0 = recv(&mut p.b, &mut b, 0, 4096);
    p.advance(10_000_000);
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::Send, i0)]
    );
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b)),
        vec![ok(WqeOpcode::Send, r0)]
    );
    assert_eq!(p.b.drv.read_mr(&b.mr, 0, 3000), data);
}

#[test]
fn more_bad_commands() {
    let mut n = Node::new(0x0200_00ff_fe00_0c00, [10, 0, 0, 3], 0x30_0000_0000);
    let cap = n.drv.cap;
    // INIT_HCA once initialised: BAD_SYS_STATE.
    let init = hca_prm::cmd::InitHca::default();
    assert_eq!(
        n.drv
            .cmd(&mut n.dev, Opcode::InitHca, 0, 0, init.as_bytes(), 0)
            .0,
        CmdStatus::BadSysState
    );
    // A port the device does not have.
    assert_eq!(
        n.drv.cmd(&mut n.dev, Opcode::QueryPort, 0, 2, &[], 4096).0,
        CmdStatus::BadPort
    );
    // A P_Key index outside the table.
    let cq = n.drv.create_cq(&mut n.dev, 4).unwrap();
    let qp = n
        .drv
        .create_qp(&mut n.dev, QpType::Rc, 1, PD, &cq, &cq, None, (4, 4))
        .unwrap();
    let mut m = bring_up::to_init(QpType::Rc, ALL_REMOTE, 0);
    m.pkey_index = Some(999);
    assert_eq!(n.drv.modify_qp(&mut n.dev, &qp, &m), CmdStatus::BadPkey);
    // A CQ larger than the device supports: a size beyond its limits.
    let cqc = Cqc {
        ring: hca_prm::ctx::BufDesc {
            log_page_size: 12,
            log_entries: cap.log_max_cqes + 1,
            log_stride: 5,
            ..Default::default()
        },
        ci_dbr: Le64::new(n.drv.mailbox_in_bus() + 2048),
        ..Cqc::default()
    };
    assert_eq!(
        n.drv
            .cmd(
                &mut n.dev,
                Opcode::Sw2HwCq,
                0,
                cq.cqn + 1,
                cqc.as_bytes(),
                0
            )
            .0,
        CmdStatus::ExceedLimit
    );
}

#[test]
fn loc_prot_err_read_into_a_region_without_local_write() {
    // PRM 7.1: a local access needs LOCAL_WRITE for writes into the region;
    // "Failure: LOC_PROT_ERR".
    let (mut p, mut a, b) = rc_pair();
    let ro = reg(&mut p.a, 4096, PD, AccessFlags::REMOTE_READ);
    let sg = [sge(&ro, 0, 16)];
    let i0 = post(
        &mut p.a,
        &mut a,
        &wr(
            1,
            SendOp::RdmaRead {
                remote: remote(&b.mr, 0),
            },
            SIG,
            &sg,
        ),
    );
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![c(WqeOpcode::RdmaRead, WcStatus::LocProtErr, i0)]
    );
    assert_eq!(p.a.dev.port_counters(1).unwrap().tx_packets, 0);
}

#[test]
fn loc_prot_err_receive_into_a_region_without_local_write() {
    let (mut p, mut a, mut b) = rc_pair();
    let ro = reg(&mut p.b, 4096, PD, AccessFlags::REMOTE_READ);
    let index = b.qp.rq_producer as u16;
    p.b.drv.post_recv(&mut b.qp, 1, &[sge(&ro, 0, 256)]);
    let sg = [sge(&a.mr, 0, 16)];
    let i0 = post(&mut p.a, &mut a, &wr(1, SendOp::Send, SIG, &sg));
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b)),
        vec![c(WqeOpcode::Send, WcStatus::LocProtErr, index)]
    );
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![c(WqeOpcode::Send, WcStatus::RemOpErr, i0)]
    );
    assert_eq!(p.b.drv.read_mr(&ro, 0, 16), vec![0; 16]);
}

#[test]
fn zero_length_send_consumes_a_receive() {
    let (mut p, mut a, mut b) = rc_pair();
    let r0 = recv(&mut p.b, &mut b, 0, 64);
    let i0 = post(&mut p.a, &mut a, &wr(1, SendOp::Send, SIG, &[]));
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::Send, i0)]
    );
    let got = cqes(&mut p.b, &mut b);
    assert_eq!(summary(&got), vec![ok(WqeOpcode::Send, r0)]);
    assert_eq!(got[0].byte_count.get(), 0);
}

#[test]
fn ud_controlled_qkey_in_a_wqe_means_the_qps_own() {
    // PRM 10.2: a Q_Key with the high bit set is replaced by the QP's.
    let (mut p, mut a, mut b) = ud_pair();
    let r0 = recv(&mut p.b, &mut b, 0, 40 + 16);
    let av = Av::try_from(&AvAttr::roce(PortNum::FIRST, Gid::from_ipv4(IP_B), 0)).unwrap();
    let sg = [sge(&a.mr, 0, 16)];
    let w = SendWr {
        wr_id: 1,
        op: SendOp::Send,
        flags: SIG,
        sg_list: &sg,
        ud: Some(UdDest {
            av: AvHandle::from_raw(1),
            remote_qpn: Qpn::new(b.qp.qpn).unwrap(),
            remote_qkey: QKey::new(0x8000_0000),
        }),
    };
    let i0 = a.qp.sq_producer as u16;
    p.a.drv
        .post_send(&mut p.a.dev, &mut a.qp, &w, Some(&av), None, true)
        .unwrap();
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::Send, i0)]
    );
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b)),
        vec![ok(WqeOpcode::Send, r0)]
    );
}

#[test]
fn close_and_init_port_raise_port_change() {
    let mut p = Pair::new();
    p.a.events();
    let port = PortNum::new(1).unwrap();
    let n = &mut p.a;
    assert_eq!(
        n.drv.cmd_param(&mut n.dev, Opcode::ClosePort, 1, 0).0,
        CmdStatus::Ok
    );
    assert_eq!(
        n.events(),
        vec![Event::PortChange {
            port,
            active: false
        }]
    );
    assert_eq!(query_port(n).state, 2, "INIT: link up, port closed");
    assert_eq!(
        n.drv.cmd_param(&mut n.dev, Opcode::InitPort, 1, 0).0,
        CmdStatus::Ok
    );
    assert_eq!(n.events(), vec![Event::PortChange { port, active: true }]);
}

#[test]
fn region_with_remote_write_but_no_local_write_is_refused() {
    let mut p = Pair::new();
    assert_eq!(
        p.a.drv
            .reg_mr(&mut p.a.dev, 4096, PD, AccessFlags::REMOTE_WRITE)
            .unwrap_err(),
        CmdStatus::BadParam
    );
}

#[test]
fn dma_fault_writing_a_completion_is_catastrophic() {
    // PRM 2: a DMA fault while writing a completion the device cannot drop
    // sets FATAL and posts CATASTROPHIC.
    let (mut p, mut a, b) = rc_pair();
    p.a.events();
    assert!(p.a.drv.mem.unmap(a.cq.ring_buf().bus));
    let sg = [sge(&a.mr, 0, 16)];
    post(
        &mut p.a,
        &mut a,
        &wr(
            1,
            SendOp::RdmaWrite {
                remote: remote(&b.mr, 0),
            },
            SIG,
            &sg,
        ),
    );
    p.pump();
    assert!(p.a.dev.is_fatal());
    let status = p.a.dev.mmio_read32(hca_prm::regs::offset::STATUS);
    assert_ne!(status & hca_prm::regs::Status::FATAL.bits(), 0);
    assert!(p.a.dev.counters().dma_faults >= 1);
    assert!(p.a.events().contains(&Event::Catastrophic));
}

#[test]
fn uc_local_error_stops_only_the_send_queue() {
    // PRM 10.5: a UC QP whose send fails locally moves to SQE; its receive
    // queue keeps working and MODIFY_QP SQE -> RTS resumes sending.
    let (mut p, mut a, mut b) = uc_pair();
    let bad = [Sge::new(a.mr.va, 16, LKey::new(a.mr.lkey.get() ^ 0x02))];
    let i0 = post(&mut p.a, &mut a, &wr(1, SendOp::Send, SIG, &bad));
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![c(WqeOpcode::Send, WcStatus::LocProtErr, i0)]
    );
    assert_eq!(p.a.qp_state(a.qp.qpn), QpState::Sqe);
    let ra = recv(&mut p.a, &mut a, 0, 64);
    let sg_b = [sge(&b.mr, 0, 16)];
    let ib = post(&mut p.b, &mut b, &wr(1, SendOp::Send, SIG, &sg_b));
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b)),
        vec![ok(WqeOpcode::Send, ib)]
    );
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::Send, ra)]
    );
    assert_eq!(
        p.a.drv
            .modify_qp(&mut p.a.dev, &a.qp, &QpModify::to_state(QpState::Rts)),
        CmdStatus::Ok
    );
    let rb = recv(&mut p.b, &mut b, 0, 64);
    let sg = [sge(&a.mr, 0, 16)];
    let i1 = post(&mut p.a, &mut a, &wr(2, SendOp::Send, SIG, &sg));
    p.pump();
    assert_eq!(
        summary(&cqes(&mut p.a, &mut a)),
        vec![ok(WqeOpcode::Send, i1)]
    );
    assert_eq!(
        summary(&cqes(&mut p.b, &mut b)),
        vec![ok(WqeOpcode::Send, rb)]
    );
}

#[test]
fn ack_timeout_and_rnr_timer_are_honoured() {
    // ACK timeout 4.096 µs · 2^4 = 65.5 µs; B's RNR timer code 1 = 10 µs.
    let (mut p, mut a, mut b) = rc_pair_with(
        Mtu::Mtu1024,
        Retries {
            timeout: 4,
            retry: 7,
            rnr_retry: 7,
        },
    );
    let tx = |n: &Node| n.dev.port_counters(1).unwrap().tx_packets;
    let sg = [sge(&a.mr, 0, 16)];
    // No receive at B: RNR NAK, then a retry no sooner than 10 µs.
    post(&mut p.a, &mut a, &wr(1, SendOp::Send, SIG, &sg));
    p.pump();
    assert_eq!(tx(&p.a), 1);
    p.advance(9_000);
    assert_eq!(tx(&p.a), 1, "too early for the RNR retry");
    p.advance(2_000);
    assert_eq!(tx(&p.a), 2, "retried after the RNR timer");
    // Now lose everything: retransmissions every 65.5 µs.
    recv(&mut p.b, &mut b, 0, 64);
    p.filter = Some(Box::new(|_, _| false));
    p.advance(10_000);
    let base = tx(&p.a);
    p.advance(60_000);
    assert_eq!(tx(&p.a), base, "too early for the ACK timeout");
    p.advance(10_000);
    assert_eq!(tx(&p.a), base + 1, "retransmitted after the ACK timeout");
    p.filter = None;
    p.advance(1_000_000);
    assert_eq!(cqes(&mut p.a, &mut a).len(), 1);
    assert_eq!(cqes(&mut p.b, &mut b).len(), 1);
}
