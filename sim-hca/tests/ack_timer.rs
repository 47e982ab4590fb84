//! The local ACK timer runs from when a (re)transmission's last packet was
//! handed to the network (IBA 9.7.6.1.3, C9-140: it measures how long a
//! request has gone unacknowledged since it was sent), not from when the
//! device began the step that built the packets (issue 14).
//!
//! The carrier here is a socket carrier's model ([`sim_hca::udp::UdpFabric`]):
//! it drains a device's frames and then sends them one after the other while
//! the clock moves on — a loaded machine or a debug build can take longer
//! to send a window than the ACK timeout — and reports the hand-off once
//! the last has gone ([`Device::start_ack_timers`]). Virtual time keeps it
//! exact and fast.

mod common;

use common::*;
use ib_types::access::AccessFlags;
use ib_types::qp::{QpState, QpType};
use ib_types::scalars::Mtu;
use ib_types::wc::WcStatus;
use ib_types::wr::{RemoteAddr, SendFlags, SendOp, SendWr};
use sim_hca::device::{Device, UnsentAckTimers};
use sim_hca::testkit::Driver;

/// The ACK timeout exponent: 4.096 µs · 2^1.
const TIMEOUT: u8 = 1;
const TIMEOUT_NS: u64 = 4096 << TIMEOUT;
/// What the carrier takes to hand one frame to the network: with 64 frames
/// a copy of the message takes 64 µs, eight ACK timeouts.
const HAND_OFF_NS_PER_FRAME: u64 = 1_000;
/// A 64 KiB RDMA write at MTU 1024: 64 packets.
const LEN: usize = 64 * 1024;
const PACKETS: usize = 64;
/// One hop of the network.
const LATENCY_NS: u64 = 1_000;

fn rc_pair(retry: u8) -> (Pair, Endpoint, Endpoint) {
    let mut p = Pair::new();
    let a = endpoint(&mut p.a, QpType::Rc, AccessFlags::empty());
    let b = endpoint(&mut p.b, QpType::Rc, AccessFlags::empty());
    let retries = Retries {
        timeout: TIMEOUT,
        retry,
        rnr_retry: 7,
    };
    connect(&mut p, &a, &b, QpType::Rc, Mtu::Mtu1024, retries);
    p.a.dev.set_ack_timers_at_hand_off(true);
    (p, a, b)
}

/// A writes its whole region into B's.
fn post_write(p: &mut Pair, a: &mut Endpoint, b: &Endpoint) -> Vec<u8> {
    let data: Vec<u8> = (0..LEN).map(|i| (i as u8).wrapping_mul(31)).collect();
    p.a.drv.write_mr(&a.mr, 0, &data);
    let sg = [Driver::sge(&a.mr, 0, LEN as u32)];
    let wr = SendWr {
        wr_id: 1,
        op: SendOp::RdmaWrite {
            remote: RemoteAddr {
                addr: b.mr.va,
                rkey: b.mr.rkey,
            },
        },
        flags: SendFlags::SIGNALED,
        sg_list: &sg,
        ud: None,
    };
    p.a.drv
        .post_send(&mut p.a.dev, &mut a.qp, &wr, None, None, true)
        .expect("a well-formed WR");
    data
}

/// Takes A's queued frames and hands them to the network as a socket
/// carrier does: one after the other, the clock moving on while it sends,
/// then reports the hand-off. Returns the frames.
fn hand_off_slowly(p: &mut Pair) -> Vec<Vec<u8>> {
    let mut frames = Vec::new();
    let mut timers = UnsentAckTimers::default();
    p.a.dev.drain_tx(|_, f| frames.push(f.to_vec()));
    p.a.dev.take_unsent_ack_timers(&mut timers);
    p.now += HAND_OFF_NS_PER_FRAME * frames.len() as u64;
    p.a.dev.start_ack_timers(&mut timers, p.now);
    frames
}

/// A timer thread looking at A at `p.now`: runs what is due.
fn run_due_timers(dev: &mut Device, now: u64) {
    if dev.poll_timeout().is_some_and(|t| t <= now) {
        dev.handle_timeout(now);
    }
}

fn statuses(node: &mut Node, ep: &mut Endpoint) -> Vec<WcStatus> {
    node.drv
        .drain_cq(&mut ep.cq)
        .iter()
        .map(|c| WcStatus::from_code(c.status).expect("a known status"))
        .collect()
}

/// The first copy of a write is lost (the peer was briefly unreachable);
/// the ACK timeout resends it, and the resend takes eight timeouts to
/// leave. A timer thread looking when its last packet has gone finds
/// nothing due, and the peer's ACK, arriving a hop later, completes the
/// write after the one retry — with `retry_cnt` 1, counting the time spent
/// sending as a second timeout would have failed it with `RETRY_EXC_ERR`
/// (what a debug build of `ib_write_bw` on a loaded machine hit).
#[test]
fn time_spent_sending_a_resend_is_not_charged_to_a_live_peer() {
    let (mut p, mut a, b) = rc_pair(1);
    let data = post_write(&mut p, &mut a, &b);

    let lost = hand_off_slowly(&mut p);
    assert_eq!(lost.len(), PACKETS);
    assert_eq!(
        p.a.dev.poll_timeout(),
        Some(p.now + TIMEOUT_NS),
        "the ACK timer runs from when the last packet left"
    );
    run_due_timers(&mut p.a.dev, p.now);
    p.now += TIMEOUT_NS;
    run_due_timers(&mut p.a.dev, p.now);

    let resent = hand_off_slowly(&mut p);
    assert_eq!(resent.len(), PACKETS, "the timeout resent the message");
    assert_eq!(
        p.a.dev.poll_timeout(),
        Some(p.now + TIMEOUT_NS),
        "the restarted ACK timer runs from when the resend's last packet left"
    );
    run_due_timers(&mut p.a.dev, p.now);
    assert!(
        hand_off_slowly(&mut p).is_empty(),
        "no second retry while the peer had no time to answer"
    );

    p.now += LATENCY_NS;
    for frame in &resent {
        p.b.dev.set_time(p.now);
        p.b.dev.receive(1, frame);
    }
    p.now += LATENCY_NS;
    p.pump();
    assert_eq!(statuses(&mut p.a, &mut a), vec![WcStatus::Success]);
    assert_eq!(p.b.drv.read_mr(&b.mr, 0, LEN), data);
    assert_eq!(p.a.dev.poll_timeout(), None, "nothing left to time");
}

/// A dead peer still ends in `RETRY_EXC_ERR`: `retry_cnt` + 1 timeouts,
/// each counted from the last packet of the copy before it, then the
/// write fails and the QP enters ERR — and nothing fires before that.
#[test]
fn a_dead_peer_times_out_retry_cnt_plus_one_times_from_each_hand_off() {
    const RETRY: u8 = 2;
    let (mut p, mut a, b) = rc_pair(RETRY);
    post_write(&mut p, &mut a, &b);

    let mut copies = 0;
    let mut expiries = 0;
    loop {
        let frames = hand_off_slowly(&mut p); // the peer is dead: all lost
        if !frames.is_empty() {
            assert_eq!(frames.len(), PACKETS, "each retry resends the message");
            copies += 1;
        }
        let Some(due) = p.a.dev.poll_timeout() else {
            break;
        };
        assert_eq!(
            due,
            p.now + TIMEOUT_NS,
            "each timeout runs from the last packet of its copy"
        );
        assert!(
            statuses(&mut p.a, &mut a).is_empty(),
            "nothing completes before the last timeout"
        );
        run_due_timers(&mut p.a.dev, due - 1);
        assert!(
            p.a.dev.poll_timeout() == Some(due),
            "not due before its time"
        );
        p.now = due;
        run_due_timers(&mut p.a.dev, p.now);
        expiries += 1;
        assert!(expiries <= 10, "the retries never end");
    }
    assert_eq!(copies, 1 + usize::from(RETRY), "the write and its retries");
    assert_eq!(expiries, 1 + usize::from(RETRY), "retry_cnt + 1 timeouts");
    assert_eq!(
        p.now,
        (1 + u64::from(RETRY)) * (PACKETS as u64 * HAND_OFF_NS_PER_FRAME + TIMEOUT_NS)
    );
    assert_eq!(statuses(&mut p.a, &mut a), vec![WcStatus::RetryExcErr]);
    assert_eq!(p.a.qp_state(a.qp.qpn), QpState::Err);
}
