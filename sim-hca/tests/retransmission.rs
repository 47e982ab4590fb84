//! RC loss recovery measured in packets (IBA 9.7.5.2 requester, 9.9.2
//! error handling): what one loss costs, what an endless loss ends in, and
//! what the responder may acknowledge. Two HCAs back to back through the
//! zero-latency pump of `common`, with a frame filter that counts (and
//! drops) frames by direction, opcode and PSN.
//!
//! Each test here failed before the fix it guards (issue 9 defects 4-7).

mod common;

use std::cell::RefCell;
use std::rc::Rc;

use common::*;
use hca_prm::av::Av;
use hca_prm::cmd::CmdStatus;
use hca_prm::ctx::QpcFlags;
use ib_types::access::AccessFlags;
use ib_types::av::AvAttr;
use ib_types::handle::AvHandle;
use ib_types::qp::{QpModify, QpState, QpType};
use ib_types::scalars::{Gid, Mtu, PortNum, QKey, Qpn};
use ib_types::wc::WcStatus;
use ib_types::wr::{RemoteAddr, SendFlags, SendOp, SendWr, Sge, UdDest};
use sim_hca::testkit::Driver;

/// Ethernet (14) + IPv4 (20) + UDP (8): where the BTH starts.
const BTH_AT: usize = 42;
const READ_RESPONSE_FIRST: u8 = 0x0D;
const READ_RESPONSE_MIDDLE: u8 = 0x0E;
const READ_RESPONSE_LAST: u8 = 0x0F;
/// The requester's first PSN (`common::connect`: A starts at 100).
const A_FIRST_PSN: u32 = 100;

/// One frame as the filter saw it.
#[derive(Debug, Clone, Copy)]
struct Seen {
    to_b: bool,
    opcode: u8,
    psn: u32,
}

fn seen(to_b: bool, frame: &[u8]) -> Seen {
    let psn = frame
        .get(BTH_AT + 9..BTH_AT + 12)
        .map_or(0, |b| u32::from_be_bytes([0, b[0], b[1], b[2]]));
    Seen {
        to_b,
        opcode: frame.get(BTH_AT).copied().unwrap_or(0xFF),
        psn,
    }
}

/// Every frame offered to the wire (delivered or dropped), in order.
type Log = Rc<RefCell<Vec<Seen>>>;

/// Installs a filter that logs every frame and drops those `drop` picks
/// (given the frame and everything logged before it).
fn watch(p: &mut Pair, mut drop: impl FnMut(&Seen, &[Seen]) -> bool + 'static) -> Log {
    let log: Log = Rc::default();
    let sink = log.clone();
    p.filter = Some(Box::new(move |to_b, frame| {
        let s = seen(to_b, frame);
        let mut log = sink.borrow_mut();
        let dropped = drop(&s, &log);
        log.push(s);
        !dropped
    }));
    log
}

fn count(log: &Log, pick: impl Fn(&Seen) -> bool) -> usize {
    log.borrow().iter().filter(|s| pick(s)).count()
}

fn is_read_response(s: &Seen) -> bool {
    !s.to_b
        && matches!(
            s.opcode,
            READ_RESPONSE_FIRST | READ_RESPONSE_MIDDLE | READ_RESPONSE_LAST | 0x10
        )
}

fn rc_pair_with(mtu: Mtu, retries: Retries) -> (Pair, Endpoint, Endpoint) {
    let mut p = Pair::new();
    let a = endpoint(&mut p.a, QpType::Rc, AccessFlags::empty());
    let b = endpoint(&mut p.b, QpType::Rc, AccessFlags::empty());
    connect(&mut p, &a, &b, QpType::Rc, mtu, retries);
    (p, a, b)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed))
        .collect()
}

fn post(node: &mut Node, ep: &mut Endpoint, wr_id: u64, op: SendOp, sg: &[Sge]) {
    let wr = SendWr {
        wr_id,
        op,
        flags: SendFlags::SIGNALED,
        sg_list: sg,
        ud: None,
    };
    node.drv
        .post_send(&mut node.dev, &mut ep.qp, &wr, None, None, true)
        .expect("a well-formed WR");
}

fn statuses(node: &mut Node, ep: &mut Endpoint) -> Vec<Result<WcStatus, u8>> {
    node.drv
        .drain_cq(&mut ep.cq)
        .iter()
        .map(|c| WcStatus::from_code(c.status).map_err(|_| c.status))
        .collect()
}

/// A 200-packet send (MTU 256, the shortest ACK timeout, `retry_cnt`
/// `retry`) of a pattern from A into B's one receive, with the frames
/// `drop` picks dropped (see `watch`), run to its end: A's completion is a
/// success and B holds the data. Returns the pair, B's endpoint and the
/// log of the frames.
fn send_200_packets_dropping(
    retry: u8,
    seed: u8,
    drop: impl FnMut(&Seen, &[Seen]) -> bool + 'static,
) -> (Pair, Endpoint, Log) {
    let retries = Retries {
        timeout: 1,
        retry,
        rnr_retry: 7,
    };
    let (mut p, mut a, mut b) = rc_pair_with(Mtu::Mtu256, retries);
    let len = 200 * 256;
    let data = pattern(len, seed);
    p.a.drv.write_mr(&a.mr, 0, &data);
    p.b.drv
        .post_recv(&mut b.qp, 1, &[Driver::sge(&b.mr, 0, len as u32)]);
    let log = watch(&mut p, drop);
    let sg = [Driver::sge(&a.mr, 0, len as u32)];
    post(&mut p.a, &mut a, 1, SendOp::Send, &sg);
    p.advance(10_000_000);
    assert_eq!(statuses(&mut p.a, &mut a), vec![Ok(WcStatus::Success)]);
    assert_eq!(p.b.drv.read_mr(&b.mr, 0, len), data);
    (p, b, log)
}

/// Posts an 8-packet RDMA READ (MTU 1024) of B's region into A's.
fn post_read_8(p: &mut Pair, a: &mut Endpoint, b: &Endpoint) {
    let sg = [Driver::sge(&a.mr, 0, 8192)];
    let remote = RemoteAddr {
        addr: b.mr.va,
        rkey: b.mr.rkey,
    };
    post(&mut p.a, a, 1, SendOp::RdmaRead { remote }, &sg);
}

// ----- defect 4: a gap in the read responses -----------------------------

/// IBA 9.7.5.2 (and rxe's completer): a read response beyond the one
/// expected is an implied NAK — one re-request from the missing response,
/// and the responses still in flight from the first request are ignored,
/// not each answered with another re-request. One lost response of an
/// 8-packet read costs one request and the 6 responses it replays.
#[test]
fn one_lost_read_response_costs_one_re_request() {
    let (mut p, mut a, b) = rc_pair_with(Mtu::Mtu1024, Retries::PATIENT);
    let data = pattern(8192, 4);
    p.b.drv.write_mr(&b.mr, 0, &data);
    // The third response (PSN + 2) is lost once.
    let log = watch(&mut p, |s, before| {
        is_read_response(s)
            && s.psn == A_FIRST_PSN + 2
            && !before.iter().any(|e| is_read_response(e) && e.psn == s.psn)
    });
    post_read_8(&mut p, &mut a, &b);
    p.advance(10_000_000);
    assert_eq!(statuses(&mut p.a, &mut a), vec![Ok(WcStatus::Success)]);
    assert_eq!(p.a.drv.read_mr(&a.mr, 0, 8192), data);
    assert_eq!(
        count(&log, |s| s.to_b),
        2,
        "the read request and one re-request from the lost response"
    );
    assert_eq!(
        count(&log, is_read_response),
        8 + 6,
        "8 responses, then responses 2..8 once more"
    );
}

/// A response that is always lost: each retry is charged to `retry_cnt`
/// (the gap's implied NAK, then the ACK timeouts), and once the count is
/// spent the read completes with `RETRY_EXC_ERR` — after `retry_cnt`
/// re-requests spread over `retry_cnt` ACK timeouts of virtual time, not an
/// endless stream of re-requests at one instant.
#[test]
fn an_always_lost_read_response_ends_in_retry_exc_err() {
    const RETRY: u8 = 3;
    let retries = Retries {
        timeout: 1,
        retry: RETRY,
        rnr_retry: 7,
    };
    let timeout_ns = 4096u64 << 1;
    let (mut p, mut a, b) = rc_pair_with(Mtu::Mtu1024, retries);
    let log = watch(&mut p, |s, _| {
        is_read_response(s) && s.psn == A_FIRST_PSN + 2
    });
    post_read_8(&mut p, &mut a, &b);
    // The gap's retry at once, then one per timeout; the last timeout ends
    // it. Just before that last timeout nothing has completed.
    p.advance(u64::from(RETRY) * timeout_ns - 1);
    assert_eq!(statuses(&mut p.a, &mut a), vec![], "still retrying");
    assert_eq!(count(&log, |s| s.to_b), 1 + usize::from(RETRY));
    p.advance(1);
    assert_eq!(statuses(&mut p.a, &mut a), vec![Ok(WcStatus::RetryExcErr)]);
    assert_eq!(
        count(&log, |s| s.to_b),
        1 + usize::from(RETRY),
        "the request and retry_cnt re-requests, no more"
    );
    assert_eq!(p.a.qp_state(a.qp.qpn), QpState::Err);
}

// ----- defect 5: no ACK for a message whose completion was lost ----------

/// IBA 9.7.5: a SEND (or RDMA WRITE with immediate) is acknowledged only
/// once the responder executed it, and executing it includes its receive
/// completion. When the receive CQ has overflowed, the responder's QP goes
/// to ERR (QP_FATAL) and answers nothing more (rxe likewise: CQ overflow
/// goes to the error state without acknowledging); the requester, seeing
/// no ACK, retries until `RETRY_EXC_ERR`. It must never report success for
/// a message the receiver's software never learned of.
///
/// Three messages of `op(receiver)` towards a receiver whose CQ holds two
/// completions and is never polled; returns the requester's completion
/// statuses.
fn three_messages_into_a_full_receive_cq(
    op: impl Fn(&Endpoint) -> SendOp,
) -> Vec<Result<WcStatus, u8>> {
    let retries = Retries {
        timeout: 1,
        retry: 2,
        rnr_retry: 7,
    };
    let mut p = Pair::new();
    let mut a = endpoint(&mut p.a, QpType::Rc, AccessFlags::empty());
    let mut b = endpoint_with(
        &mut p.b,
        QpType::Rc,
        1,
        QpcFlags::empty(),
        AccessFlags::empty(),
    );
    connect(&mut p, &a, &b, QpType::Rc, Mtu::Mtu1024, retries);
    for k in 0..3u64 {
        let sg = Driver::sge(&b.mr, k * 256, 256);
        p.b.drv.post_recv(&mut b.qp, k, &[sg]);
    }
    let sg = [Driver::sge(&a.mr, 0, 64)];
    let op = op(&b);
    for k in 0..3 {
        post(&mut p.a, &mut a, k, op, &sg);
    }
    p.advance(10_000_000);
    assert_eq!(p.b.qp_state(b.qp.qpn), QpState::Err);
    statuses(&mut p.a, &mut a)
}

const TWO_THEN_NO_ACK: [Result<WcStatus, u8>; 3] = [
    Ok(WcStatus::Success),
    Ok(WcStatus::Success),
    Ok(WcStatus::RetryExcErr),
];

#[test]
fn a_send_whose_receive_completion_overflowed_is_not_acknowledged() {
    assert_eq!(
        three_messages_into_a_full_receive_cq(|_| SendOp::Send),
        TWO_THEN_NO_ACK,
        "the third send's receive completion was lost: no ACK, so no success"
    );
}

#[test]
fn a_write_with_immediate_whose_completion_overflowed_is_not_acknowledged() {
    let op = |b: &Endpoint| SendOp::RdmaWriteWithImm {
        remote: RemoteAddr {
            addr: b.mr.va + 4096,
            rkey: b.mr.rkey,
        },
        imm: ib_types::abi::Be32::new(7),
    };
    assert_eq!(
        three_messages_into_a_full_receive_cq(op),
        TWO_THEN_NO_ACK,
        "the third write's receive completion was lost: no ACK, so no success"
    );
}

// ----- defect 6: retransmission resumes after the last ACKed PSN ---------

/// A 200-packet send (MTU 256) asks for an ACK every 64 packets; its last
/// packet is lost once. The ACKs of PSNs 63, 127 and 191 arrived, so the
/// timeout resends only packets 192..200 (IBA 9.7.5.2: retransmission
/// starts at the oldest unacknowledged PSN, which may be inside a message).
#[test]
fn retransmission_resumes_after_the_last_acknowledged_psn() {
    let last = A_FIRST_PSN + 199;
    let (mut p, mut b, log) = send_200_packets_dropping(7, 6, move |s, before| {
        s.to_b && s.psn == last && !before.iter().any(|e| e.to_b && e.psn == last)
    });
    assert_eq!(statuses(&mut p.b, &mut b), vec![Ok(WcStatus::Success)]);
    assert_eq!(
        count(&log, |s| s.to_b),
        200 + 8,
        "200 packets, then the 8 after the last acknowledged PSN"
    );
}

/// A partial ACK is progress: it restarts the ACK timer and gives the
/// requester its whole retry budget again (IBA 9.7.6.1.3: the retry count
/// counts consecutive retries without progress). With `retry_cnt` 1, a
/// 200-packet send loses its tail (packets 127..200) once, is resent from
/// packet 64 (ACKed through 63) and loses its last packet again; the ACKs
/// of 127 and 191 in between are progress, so the second timeout still
/// has a retry, resending packets 192..200.
#[test]
fn a_partial_ack_refreshes_the_retry_budget() {
    let (_, _, log) = send_200_packets_dropping(1, 8, |s, before| {
        if !s.to_b {
            return false;
        }
        let index = s.psn.wrapping_sub(A_FIRST_PSN);
        let sent_before = before.iter().filter(|e| e.to_b && e.psn == s.psn).count();
        (index >= 127 && sent_before == 0) || (index == 199 && sent_before == 1)
    });
    assert_eq!(
        count(&log, |s| s.to_b),
        200 + (200 - 64) + 8,
        "the message, then from packet 64, then from packet 192"
    );
}

// ----- defect 7: smaller deviations ---------------------------------------

/// IBA 9.9.2 (and rxe's completer): a PSN sequence error NAK starts a
/// retry, and every retry is charged to `retry_cnt`. A 4-packet send
/// (`retry_cnt` 1) loses packet 1; the NAK of that PSN acknowledges packet
/// 0 (progress) and spends the one retry on resending packets 1..4, which
/// are lost too; the next ACK timeout finds the count spent.
#[test]
fn a_psn_sequence_nak_consumes_a_retry() {
    let retries = Retries {
        timeout: 1,
        retry: 1,
        rnr_retry: 7,
    };
    let (mut p, mut a, mut b) = rc_pair_with(Mtu::Mtu1024, retries);
    p.b.drv
        .post_recv(&mut b.qp, 1, &[Driver::sge(&b.mr, 0, 4096)]);
    // Packet 1 is lost, and so is everything after the first 4 packets.
    let log = watch(&mut p, |s, before| {
        let requests = before.iter().filter(|e| e.to_b).count();
        s.to_b && (s.psn == A_FIRST_PSN + 1 || requests >= 4)
    });
    let sg = [Driver::sge(&a.mr, 0, 4096)];
    post(&mut p.a, &mut a, 1, SendOp::Send, &sg);
    p.advance(10_000_000);
    assert_eq!(statuses(&mut p.a, &mut a), vec![Ok(WcStatus::RetryExcErr)]);
    assert_eq!(
        count(&log, |s| s.to_b),
        4 + 3,
        "the message, and one retry (after the NAK) of packets 1..4"
    );
}

/// `max_rd_atomic` 0: the requester may have no RDMA READ or atomic
/// outstanding (the initiator depth of IBA chapter 11; rxe and qib hold the
/// WQE until a credit frees). So a read waits at the head of the send
/// queue, nothing goes on the wire and nothing completes, until the limit
/// is raised (SQD -> SQD, IBA Table 91); then it runs and succeeds.
#[test]
fn max_rd_atomic_zero_allows_no_outstanding_read() {
    let (mut p, mut a, b) = rc_pair_with(Mtu::Mtu1024, Retries::PATIENT);
    let set_limit = |p: &mut Pair, a: &Endpoint, limit: u8| {
        for m in [
            QpModify::to_state(QpState::Sqd),
            QpModify {
                state: Some(QpState::Sqd),
                max_rd_atomic: Some(limit),
                ..QpModify::default()
            },
            QpModify::to_state(QpState::Rts),
        ] {
            assert_eq!(p.a.drv.modify_qp(&mut p.a.dev, &a.qp, &m), CmdStatus::Ok);
        }
    };
    set_limit(&mut p, &a, 0);
    let data = pattern(2048, 9);
    p.b.drv.write_mr(&b.mr, 0, &data);
    let log = watch(&mut p, |_, _| false);
    let remote = RemoteAddr {
        addr: b.mr.va,
        rkey: b.mr.rkey,
    };
    let sg = [Driver::sge(&a.mr, 0, 2048)];
    post(&mut p.a, &mut a, 1, SendOp::RdmaRead { remote }, &sg);
    p.advance(1_000_000_000);
    assert_eq!(count(&log, |s| s.to_b), 0, "no read request is sent");
    assert_eq!(statuses(&mut p.a, &mut a), vec![], "the read waits");
    set_limit(&mut p, &a, 1);
    p.advance(1_000_000);
    assert_eq!(count(&log, |s| s.to_b), 1);
    assert_eq!(statuses(&mut p.a, &mut a), vec![Ok(WcStatus::Success)]);
    assert_eq!(p.a.drv.read_mr(&a.mr, 0, 2048), data);
}

/// IBA 9.8 (UD requester): every UD packet carries the next PSN of the
/// send queue, which advances by one per packet.
#[test]
fn each_ud_send_advances_the_psn() {
    const QKEY: u32 = 0x1111_2222;
    let mut p = Pair::new();
    let mut a = endpoint(&mut p.a, QpType::Ud, AccessFlags::empty());
    let mut b = endpoint(&mut p.b, QpType::Ud, AccessFlags::empty());
    for (node, ep) in [(&mut p.a, &a), (&mut p.b, &b)] {
        for m in [
            bring_up::to_init(QpType::Ud, AccessFlags::empty(), QKEY),
            bring_up::to_rtr(QpType::Ud, [0; 4], 0, 0, Mtu::Mtu1024),
            bring_up::to_rts(QpType::Ud, 77, 0, 0, 0),
        ] {
            assert_eq!(node.drv.modify_qp(&mut node.dev, &ep.qp, &m), CmdStatus::Ok);
        }
    }
    let log = watch(&mut p, |_, _| false);
    let av = Av::try_from(&AvAttr::roce(PortNum::FIRST, Gid::from_ipv4(IP_B), 0)).unwrap();
    for k in 0..3u64 {
        p.b.drv
            .post_recv(&mut b.qp, k, &[Driver::sge(&b.mr, k * 256, 256)]);
        let sg = [Driver::sge(&a.mr, 0, 16)];
        let wr = SendWr {
            wr_id: k,
            op: SendOp::Send,
            flags: SendFlags::SIGNALED,
            sg_list: &sg,
            ud: Some(UdDest {
                av: AvHandle::from_raw(1),
                remote_qpn: Qpn::new(b.qp.qpn).unwrap(),
                remote_qkey: QKey::new(QKEY),
            }),
        };
        p.a.drv
            .post_send(&mut p.a.dev, &mut a.qp, &wr, Some(&av), None, true)
            .expect("a well-formed UD WR");
    }
    p.pump();
    assert_eq!(statuses(&mut p.b, &mut b).len(), 3);
    let psns: Vec<u32> = log
        .borrow()
        .iter()
        .filter(|s| s.to_b)
        .map(|s| s.psn)
        .collect();
    assert_eq!(psns, vec![77, 78, 79], "the SQ PSN, one per packet");
    assert_eq!(statuses(&mut p.a, &mut a).len(), 3);
}

// ----- duplicates draw an ACK only when they ask for one -----------------

/// IBA 9.7.5.1.2: a duplicate SEND or RDMA WRITE packet is acknowledged
/// as a new one is, when it asks (AckReq: the last packet of a message,
/// every 64th of a long one), not each. A 200-packet send whose last ACK
/// is lost is resent from the last acknowledged PSN: 8 duplicate packets,
/// of which only the last asks, draw one ACK, not 8 (over UDP, a burst of
/// duplicates answered packet by packet flooded the requester's socket
/// and collapsed perftest's ib_write_bw, docs/performance.md).
#[test]
fn resent_duplicates_draw_one_ack_per_ack_request() {
    let last = A_FIRST_PSN + 199;
    // The first ACK of the last PSN is lost.
    let (mut p, mut b, log) = send_200_packets_dropping(7, 9, move |s, before| {
        !s.to_b && s.psn == last && !before.iter().any(|e| !e.to_b && e.psn == last)
    });
    assert_eq!(statuses(&mut p.b, &mut b), vec![Ok(WcStatus::Success)]);
    let log = log.borrow();
    let lost_at = log
        .iter()
        .position(|s| !s.to_b && s.psn == last)
        .expect("the last PSN was acknowledged");
    let resent = log[lost_at..].iter().filter(|s| s.to_b).count();
    let acks_after = log[lost_at + 1..].iter().filter(|s| !s.to_b).count();
    assert_eq!(resent, 8, "the 8 packets after the last acknowledged PSN");
    assert_eq!(
        acks_after,
        1,
        "one ACK for the one duplicate that asked: {:?}",
        &log[lost_at..]
    );
}
