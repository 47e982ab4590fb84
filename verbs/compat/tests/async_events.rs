//! Asynchronous events, called in-process as a C program calls them, on
//! the embedded simulated machine: the context's `async_fd` a real
//! descriptor (`poll`, `O_NONBLOCK` giving `EAGAIN`), and the events our
//! stack raises reaching `ibv_get_async_event` with rdma-core's types and
//! the program's own objects as elements: the SRQ limit (armed with
//! `ibv_modify_srq`, reached by receives taken by two RC QPs connected to
//! each other on the port, then disarmed as `ibv_query_srq` shows), the
//! send queue drained (`IBV_QP_EN_SQD_ASYNC_NOTIFY`), and a remote access
//! error (an RDMA write with an R_Key the responder does not have: the
//! responder's `IBV_EVENT_QP_ACCESS_ERR`), and a CQ overrun
//! (`IBV_EVENT_CQ_ERR` naming the CQ). The destroy rule: `ibv_destroy_qp`
//! and `ibv_destroy_cq` of an object with an event taken and not
//! acknowledged wait for `ibv_ack_async_event` (a thread destroys, the
//! test acknowledges; meanwhile the QP's query and post are refused: its
//! slot is taken before the kernel destroys it), and an event of an object destroyed before it was
//! taken is dropped (the SRQ responder's last-WQE-reached; a drained QP's). Then a
//! clean shutdown (the event thread ended by `ibv_close_device`).

use std::ffi::c_int;
use std::ptr::null_mut;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ibverbs_abi::{
    IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_WRITE, IBV_EVENT_CQ_ERR, IBV_EVENT_QP_ACCESS_ERR,
    IBV_EVENT_QP_FATAL, IBV_EVENT_SQ_DRAINED, IBV_EVENT_SRQ_LIMIT_REACHED, IBV_MTU_1024,
    IBV_QP_ACCESS_FLAGS, IBV_QP_AV, IBV_QP_DEST_QPN, IBV_QP_EN_SQD_ASYNC_NOTIFY,
    IBV_QP_MAX_DEST_RD_ATOMIC, IBV_QP_MAX_QP_RD_ATOMIC, IBV_QP_MIN_RNR_TIMER, IBV_QP_PATH_MTU,
    IBV_QP_PKEY_INDEX, IBV_QP_PORT, IBV_QP_RETRY_CNT, IBV_QP_RNR_RETRY, IBV_QP_RQ_PSN,
    IBV_QP_SQ_PSN, IBV_QP_STATE, IBV_QP_TIMEOUT, IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS,
    IBV_QPS_SQD, IBV_QPT_RC, IBV_SEND_SIGNALED, IBV_SRQ_LIMIT, IBV_WC_RECV, IBV_WC_REM_ACCESS_ERR,
    IBV_WC_SEND, IBV_WC_SUCCESS, IBV_WR_RDMA_WRITE, IBV_WR_SEND, IbvAhAttr, IbvAsyncEvent,
    IbvContext, IbvCq, IbvGid, IbvGlobalRoute, IbvPd, IbvQp, IbvQpAttr, IbvQpCap, IbvQpInitAttr,
    IbvRecvWr, IbvSendWr, IbvSendWrRdma, IbvSendWrWr, IbvSge, IbvSrq, IbvSrqAttr, IbvSrqInitAttr,
};
use ibverbs_compat::{self as verbs};

mod support;
use support::*;

/// The SRQ's depth, all posted; the limit is armed above what stays after
/// `SENDS` receives are taken.
const DEPTH: u32 = 8;
const SENDS: u32 = 3;

/// `poll(2)` on `fd` for input: true when readable within `timeout`.
fn readable(fd: c_int, timeout: Duration) -> bool {
    let mut poll = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let ready = unsafe { libc::poll(&mut poll, 1, timeout.as_millis() as c_int) };
    assert!(ready >= 0, "poll: errno {}", errno());
    ready == 1 && poll.revents & libc::POLLIN != 0
}

/// The next event, as a program with a non-blocking descriptor takes it:
/// `poll`, then `ibv_get_async_event`, again on `EAGAIN` (the count an
/// event dropped by a destroy left makes the descriptor readable once
/// with nothing to take).
fn next_event(context: *mut IbvContext, fd: c_int) -> IbvAsyncEvent {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(readable(fd, left), "no event in 20 s");
        // SAFETY: an all-zero event is a valid value (a NULL element).
        let mut event: IbvAsyncEvent = unsafe { std::mem::zeroed() };
        clear_errno();
        // SAFETY: `event` is valid for a write; the context is checked.
        match unsafe { verbs::ibv_get_async_event(context, &mut event) } {
            0 => return event,
            _ => assert_eq!(errno(), libc::EAGAIN),
        }
    }
}

/// An RC QP on `cq`; its receives from `srq`, or its own queue of
/// `recv_wr` when `srq` is NULL.
fn create_rc_qp(pd: *mut IbvPd, cq: *mut IbvCq, srq: *mut IbvSrq, recv_wr: u32) -> *mut IbvQp {
    let mut init = IbvQpInitAttr {
        qp_context: null_mut(),
        send_cq: cq,
        recv_cq: cq,
        srq,
        cap: IbvQpCap {
            max_send_wr: 8,
            max_recv_wr: if srq.is_null() { recv_wr } else { 0 },
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        qp_type: IBV_QPT_RC,
        sq_sig_all: 0,
    };
    // SAFETY: `init` is valid; the pointers are checked.
    let qp = unsafe { verbs::ibv_create_qp(pd, &mut init) };
    assert!(!qp.is_null(), "errno {}", errno());
    qp
}

fn modify(qp: *mut IbvQp, attr: IbvQpAttr, mask: u32) -> c_int {
    let mut attr = attr;
    // SAFETY: `attr` is valid; the QP is checked.
    unsafe { verbs::ibv_modify_qp(qp, &mut attr, mask as c_int) }
}

/// Moves `qp` to RTS connected to `remote` on the port's own GID (the
/// in-process fabric reaches the port itself), allowing the remote side
/// `access`.
fn connect(qp: *mut IbvQp, remote: u32, gid: IbvGid, access: u32) {
    let init = IbvQpAttr {
        qp_state: IBV_QPS_INIT,
        pkey_index: 0,
        port_num: 1,
        qp_access_flags: access,
        ..Default::default()
    };
    assert_eq!(
        modify(
            qp,
            init,
            IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS
        ),
        0
    );
    let rtr = IbvQpAttr {
        qp_state: IBV_QPS_RTR,
        path_mtu: IBV_MTU_1024,
        dest_qp_num: remote,
        rq_psn: 0,
        max_dest_rd_atomic: 1,
        min_rnr_timer: 12,
        ah_attr: IbvAhAttr {
            grh: IbvGlobalRoute {
                dgid: gid,
                flow_label: 0,
                sgid_index: 0,
                hop_limit: 1,
                traffic_class: 0,
            },
            is_global: 1,
            port_num: 1,
            ..Default::default()
        },
        ..Default::default()
    };
    assert_eq!(
        modify(
            qp,
            rtr,
            IBV_QP_STATE
                | IBV_QP_AV
                | IBV_QP_PATH_MTU
                | IBV_QP_DEST_QPN
                | IBV_QP_RQ_PSN
                | IBV_QP_MAX_DEST_RD_ATOMIC
                | IBV_QP_MIN_RNR_TIMER
        ),
        0
    );
    let rts = IbvQpAttr {
        qp_state: IBV_QPS_RTS,
        sq_psn: 0,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 1,
        ..Default::default()
    };
    assert_eq!(
        modify(
            qp,
            rts,
            IBV_QP_STATE
                | IBV_QP_SQ_PSN
                | IBV_QP_TIMEOUT
                | IBV_QP_RETRY_CNT
                | IBV_QP_RNR_RETRY
                | IBV_QP_MAX_QP_RD_ATOMIC
        ),
        0
    );
}

/// `count` zero-length receives posted to `qp`'s own queue.
fn post_receives(context: *mut IbvContext, qp: *mut IbvQp, count: u32) {
    // SAFETY: the open context.
    let post_recv = unsafe { (*context).ops.post_recv }.unwrap();
    for i in 0..count {
        let mut receive = IbvRecvWr {
            wr_id: 200 + u64::from(i),
            next: null_mut(),
            sg_list: null_mut(),
            num_sge: 0,
        };
        let mut bad = null_mut();
        // SAFETY: a valid request and out-pointer.
        assert_eq!(unsafe { post_recv(qp, &mut receive, &mut bad) }, 0);
    }
}

fn post_send(context: *mut IbvContext, qp: *mut IbvQp, wr: &mut IbvSendWr) {
    // SAFETY: the open context.
    let post_send = unsafe { (*context).ops.post_send }.unwrap();
    let mut bad = null_mut();
    // SAFETY: a valid list and out-pointer.
    assert_eq!(unsafe { post_send(qp, wr, &mut bad) }, 0);
}

fn query_srq(srq: *mut IbvSrq) -> IbvSrqAttr {
    let mut attr = IbvSrqAttr::default();
    // SAFETY: `attr` is valid for a write; the SRQ is checked.
    assert_eq!(unsafe { verbs::ibv_query_srq(srq, &mut attr) }, 0);
    attr
}

fn arm_srq_limit(srq: *mut IbvSrq, srq_limit: u32) {
    let mut attr = IbvSrqAttr {
        max_wr: 0,
        max_sge: 0,
        srq_limit,
    };
    // SAFETY: `attr` is valid; the SRQ is checked.
    let answer = unsafe { verbs::ibv_modify_srq(srq, &mut attr, IBV_SRQ_LIMIT as c_int) };
    assert_eq!(answer, 0);
}

/// A raw pointer the destroying thread may carry (the library checks it).
struct SendPtr(*mut IbvQp);
// SAFETY: only handed to `ibv_destroy_qp`, which any thread may call.
unsafe impl Send for SendPtr {}

/// As [`SendPtr`], for a CQ.
struct SendCq(*mut IbvCq);
// SAFETY: only handed to `ibv_destroy_cq`, which any thread may call.
unsafe impl Send for SendCq {}

#[test]
fn async_events_reach_the_program_and_destroys_wait_for_their_acknowledgement() {
    let (list, context) = open_the_device(boot);
    let machine = MACHINE.get().unwrap();

    // The descriptor: real, pollable, non-blocking on request.
    // SAFETY: the open context.
    let fd = unsafe { (*context).async_fd };
    assert!(fd >= 0);
    // SAFETY: plain fcntl on a descriptor of ours.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    assert!(flags >= 0, "the descriptor is open");
    // SAFETY: as above.
    let answer = unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) };
    assert_eq!(answer, 0);
    assert!(!readable(fd, Duration::ZERO));
    // SAFETY: an all-zero event is a valid value.
    let mut event: IbvAsyncEvent = unsafe { std::mem::zeroed() };
    clear_errno();
    // SAFETY: `event` is valid for a write.
    let answer = unsafe { verbs::ibv_get_async_event(context, &mut event) };
    assert_eq!(answer, -1);
    assert_eq!(errno(), libc::EAGAIN);
    // Refusals: NULL event, a context that is not ours.
    clear_errno();
    // SAFETY: NULL is checked.
    let answer = unsafe { verbs::ibv_get_async_event(context, null_mut()) };
    assert_eq!(answer, -1);
    assert_eq!(errno(), libc::EINVAL);
    clear_errno();
    // SAFETY: a list of one device and a NULL.
    let device = unsafe { *list };
    // SAFETY: a pointer that is not a context is checked.
    let answer = unsafe { verbs::ibv_get_async_event(device.cast(), &mut event) };
    assert_eq!(answer, -1);
    assert_eq!(errno(), libc::EINVAL);
    // Acknowledging NULL or an event naming nothing of ours does nothing.
    // SAFETY: NULL is checked; the zeroed event names no object.
    unsafe { verbs::ibv_ack_async_event(null_mut()) };
    // SAFETY: as above.
    unsafe { verbs::ibv_ack_async_event(&mut event) };

    let (pd, cq) = pd_and_cq(context, 64);
    let mut srq_init = IbvSrqInitAttr {
        srq_context: null_mut(),
        attr: IbvSrqAttr {
            max_wr: DEPTH,
            max_sge: 1,
            srq_limit: 0,
        },
    };
    // SAFETY: `srq_init` is valid; the PD is checked.
    let srq = unsafe { verbs::ibv_create_srq(pd, &mut srq_init) };
    assert!(!srq.is_null());
    let depth = srq_init.attr.max_wr;
    // Every slot posted with a zero-length receive (the sends carry no
    // bytes).
    let mut receives: Vec<IbvRecvWr> = (0..depth)
        .map(|i| IbvRecvWr {
            wr_id: 100 + u64::from(i),
            next: null_mut(),
            sg_list: null_mut(),
            num_sge: 0,
        })
        .collect();
    for at in 1..receives.len() {
        let next = std::ptr::from_mut(&mut receives[at]);
        receives[at - 1].next = next;
    }
    // SAFETY: the open context.
    let post_srq_recv = unsafe { (*context).ops.post_srq_recv }.unwrap();
    let mut bad = null_mut();
    // SAFETY: a valid list and out-pointer.
    let answer = unsafe { post_srq_recv(srq, receives.as_mut_ptr(), &mut bad) };
    assert_eq!(answer, 0);
    arm_srq_limit(srq, depth - SENDS + 1);
    let armed = depth - SENDS + 1;
    assert_eq!(query_srq(srq).srq_limit, armed);

    // Two RC QPs connected to each other on the port: the requester with
    // its own receive queue, the responder on the SRQ, allowing remote
    // writes.
    let requester = create_rc_qp(pd, cq, null_mut(), 1);
    let responder = create_rc_qp(pd, cq, srq, 0);
    let mut gid = IbvGid::default();
    // SAFETY: `gid` is valid for a write.
    assert_eq!(unsafe { verbs::ibv_query_gid(context, 1, 0, &mut gid) }, 0);
    // SAFETY: a live QP of ours.
    let requester_qpn = unsafe { (*requester).qp_num };
    // SAFETY: as above.
    let responder_qpn = unsafe { (*responder).qp_num };
    connect(requester, responder_qpn, gid, 0);
    connect(responder, requester_qpn, gid, IBV_ACCESS_REMOTE_WRITE);

    // The SRQ limit: `SENDS` receives taken leave fewer than armed.
    for i in 0..SENDS {
        // SAFETY: an all-zero request is a valid value.
        let mut send: IbvSendWr = unsafe { std::mem::zeroed() };
        send.wr_id = u64::from(i);
        send.opcode = IBV_WR_SEND;
        send.send_flags = IBV_SEND_SIGNALED;
        post_send(context, requester, &mut send);
    }
    let mut sends = 0;
    let mut recvs = 0;
    for _ in 0..2 * SENDS {
        let wc = poll_one(context, cq);
        assert_eq!(wc.status, IBV_WC_SUCCESS, "{wc:?}");
        match wc.opcode {
            IBV_WC_SEND => sends += 1,
            IBV_WC_RECV => recvs += 1,
            other => panic!("opcode {other}"),
        }
    }
    assert_eq!((sends, recvs), (SENDS, SENDS));
    let event = next_event(context, fd);
    assert_eq!(event.event_type, IBV_EVENT_SRQ_LIMIT_REACHED);
    // SAFETY: an SRQ event's element is the SRQ.
    assert_eq!(unsafe { event.element.srq }, srq);
    assert_eq!(query_srq(srq).srq_limit, 0, "the limit is disarmed");
    let mut event = event;
    // SAFETY: the event just taken.
    unsafe { verbs::ibv_ack_async_event(&mut event) };
    assert!(!readable(fd, Duration::ZERO), "one event only");

    // The send queue drained, with notification: the requester's event.
    let sqd = IbvQpAttr {
        qp_state: IBV_QPS_SQD,
        en_sqd_async_notify: 1,
        ..Default::default()
    };
    assert_eq!(
        modify(requester, sqd, IBV_QP_STATE | IBV_QP_EN_SQD_ASYNC_NOTIFY),
        0
    );
    let mut event = next_event(context, fd);
    assert_eq!(event.event_type, IBV_EVENT_SQ_DRAINED);
    // SAFETY: a QP event's element is the QP.
    assert_eq!(unsafe { event.element.qp }, requester);
    // SAFETY: the event just taken.
    unsafe { verbs::ibv_ack_async_event(&mut event) };
    let rts = IbvQpAttr {
        qp_state: IBV_QPS_RTS,
        ..Default::default()
    };
    assert_eq!(modify(requester, rts, IBV_QP_STATE), 0);

    // A remote access error: an RDMA write with an R_Key the responder
    // does not have.
    let buffer = ProgramBuffer::new(1);
    // SAFETY: the program's own page, kept until the region is gone.
    let mr =
        unsafe { verbs::ibv_reg_mr(pd, buffer.ptr.cast(), PAGE, IBV_ACCESS_LOCAL_WRITE as c_int) };
    assert!(!mr.is_null(), "errno {}", errno());
    let mut sge = IbvSge {
        addr: buffer.ptr as u64,
        length: 8,
        // SAFETY: a live region of ours.
        lkey: unsafe { (*mr).lkey },
    };
    // SAFETY: an all-zero request is a valid value.
    let mut write: IbvSendWr = unsafe { std::mem::zeroed() };
    write.wr_id = 7;
    write.sg_list = &mut sge;
    write.num_sge = 1;
    write.opcode = IBV_WR_RDMA_WRITE;
    write.send_flags = IBV_SEND_SIGNALED;
    write.wr = IbvSendWrWr {
        rdma: IbvSendWrRdma {
            remote_addr: 0x1000,
            rkey: 0x4242,
        },
    };
    post_send(context, requester, &mut write);
    let wc = poll_one(context, cq);
    assert_eq!((wc.wr_id, wc.status), (7, IBV_WC_REM_ACCESS_ERR), "{wc:?}");
    let event = next_event(context, fd);
    assert_eq!(event.event_type, IBV_EVENT_QP_ACCESS_ERR);
    // SAFETY: a QP event's element is the QP.
    assert_eq!(unsafe { event.element.qp }, responder);

    // The destroy rule: with that event not acknowledged, destroying the
    // responder waits for the acknowledgement.
    let acked = Arc::new(AtomicBool::new(false));
    let destroying = {
        let acked = Arc::clone(&acked);
        let qp = SendPtr(responder);
        std::thread::spawn(move || {
            let qp = qp;
            // SAFETY: a live QP of ours.
            let result = unsafe { verbs::ibv_destroy_qp(qp.0) };
            (result, acked.load(Ordering::Acquire))
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    assert!(!destroying.is_finished(), "the destroy waits for the ack");
    // While it waits, the QP is out of its slot already: a call on it is
    // refused, never run on an object the kernel destroyed (the event's
    // element stays only an address to compare and acknowledge).
    let mut attr = IbvQpAttr::default();
    // SAFETY: an all-zero value is valid (pointers NULL).
    let mut init: IbvQpInitAttr = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointers; the QP is checked.
    let queried =
        unsafe { verbs::ibv_query_qp(responder, &mut attr, IBV_QP_STATE as c_int, &mut init) };
    assert_eq!(queried, libc::EINVAL, "a query during the destroy");
    // SAFETY: an all-zero request is a valid value.
    let mut send: IbvSendWr = unsafe { std::mem::zeroed() };
    send.opcode = IBV_WR_SEND;
    // SAFETY: the open context.
    let raw_post_send = unsafe { (*context).ops.post_send }.unwrap();
    let mut bad = null_mut();
    // SAFETY: a valid request and out-pointer; the QP is checked.
    let posted = unsafe { raw_post_send(responder, &mut send, &mut bad) };
    assert_eq!(posted, libc::EINVAL, "a post during the destroy");
    acked.store(true, Ordering::Release);
    let mut event = event;
    // SAFETY: the event taken above; its QP is still valid (the destroy
    // waits).
    unsafe { verbs::ibv_ack_async_event(&mut event) };
    assert_eq!(destroying.join().unwrap(), (0, true));

    // A CQ overrun: a pair of QPs completing on a CQ of few entries that
    // nobody polls. The CQ's `IBV_EVENT_CQ_ERR` names it (the QP whose
    // completion did not fit has its own event, acknowledged at once); with
    // it not acknowledged, `ibv_destroy_cq` waits.
    // SAFETY: checked against the open contexts.
    let small = unsafe { verbs::ibv_create_cq(context, 1, null_mut(), null_mut(), 0) };
    assert!(!small.is_null());
    // SAFETY: a live CQ of ours.
    let entries = u32::try_from(unsafe { (*small).cqe }).unwrap();
    let overrun = entries + 2;
    let sender = create_rc_qp(pd, small, null_mut(), 1);
    let receiver = create_rc_qp(pd, small, null_mut(), overrun);
    post_receives(context, receiver, overrun);
    // SAFETY: live QPs of ours.
    let sender_qpn = unsafe { (*sender).qp_num };
    // SAFETY: as above.
    let receiver_qpn = unsafe { (*receiver).qp_num };
    connect(sender, receiver_qpn, gid, 0);
    connect(receiver, sender_qpn, gid, 0);
    for i in 0..overrun {
        // SAFETY: an all-zero request is a valid value.
        let mut send: IbvSendWr = unsafe { std::mem::zeroed() };
        send.wr_id = 300 + u64::from(i);
        send.opcode = IBV_WR_SEND;
        send.send_flags = IBV_SEND_SIGNALED;
        post_send(context, sender, &mut send);
    }
    let cq_error = loop {
        let mut event = next_event(context, fd);
        if event.event_type == IBV_EVENT_CQ_ERR {
            break event;
        }
        // SAFETY: a QP event's element is the QP.
        let qp = unsafe { event.element.qp };
        assert!(
            event.event_type == IBV_EVENT_QP_FATAL && (qp == sender || qp == receiver),
            "event {}",
            event.event_type
        );
        // SAFETY: the event just taken.
        unsafe { verbs::ibv_ack_async_event(&mut event) };
    };
    // SAFETY: a CQ event's element is the CQ.
    assert_eq!(unsafe { cq_error.element.cq }, small);
    // SAFETY: live QPs of ours, each destroyed once (their events acked).
    assert_eq!(unsafe { verbs::ibv_destroy_qp(sender) }, 0);
    // SAFETY: as above.
    assert_eq!(unsafe { verbs::ibv_destroy_qp(receiver) }, 0);
    let acked = Arc::new(AtomicBool::new(false));
    let destroying = {
        let acked = Arc::clone(&acked);
        let cq = SendCq(small);
        std::thread::spawn(move || {
            let cq = cq;
            // SAFETY: a live CQ of ours.
            let result = unsafe { verbs::ibv_destroy_cq(cq.0) };
            (result, acked.load(Ordering::Acquire))
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    assert!(!destroying.is_finished(), "the destroy waits for the ack");
    acked.store(true, Ordering::Release);
    let mut cq_error = cq_error;
    // SAFETY: the event taken above; its CQ is still valid (the destroy
    // waits).
    unsafe { verbs::ibv_ack_async_event(&mut cq_error) };
    assert_eq!(destroying.join().unwrap(), (0, true));

    // An event of an object destroyed before it was taken is dropped. The
    // counts of the events earlier destroys dropped are taken first (the
    // responder's last-WQE-reached, a QP's fatal error after the CQ's):
    // nothing is queued.
    clear_errno();
    // SAFETY: `event` is valid for a write.
    let answer = unsafe { verbs::ibv_get_async_event(context, &mut event) };
    assert_eq!((answer, errno()), (-1, libc::EAGAIN), "nothing queued");
    assert!(!readable(fd, Duration::ZERO));
    // A QP connected to itself drained with notification: its event is
    // queued (the descriptor readable), then the QP is destroyed.
    let drained = create_rc_qp(pd, cq, null_mut(), 1);
    // SAFETY: a live QP of ours.
    let drained_qpn = unsafe { (*drained).qp_num };
    connect(drained, drained_qpn, gid, 0);
    assert_eq!(
        modify(drained, sqd, IBV_QP_STATE | IBV_QP_EN_SQD_ASYNC_NOTIFY),
        0
    );
    assert!(readable(fd, Duration::from_secs(20)), "the QP drained");
    // SAFETY: a live QP of ours, destroyed once.
    assert_eq!(unsafe { verbs::ibv_destroy_qp(drained) }, 0);
    clear_errno();
    // SAFETY: `event` is valid for a write.
    let answer = unsafe { verbs::ibv_get_async_event(context, &mut event) };
    assert_eq!(
        (answer, errno()),
        (-1, libc::EAGAIN),
        "the destroyed QP's event was dropped"
    );
    // SAFETY: live objects of ours, destroyed once.
    assert_eq!(unsafe { verbs::ibv_destroy_qp(requester) }, 0);
    // SAFETY: as above.
    assert_eq!(unsafe { verbs::ibv_destroy_srq(srq) }, 0);

    // SAFETY: live objects of ours, each destroyed once.
    assert_eq!(unsafe { verbs::ibv_dereg_mr(mr) }, 0);
    // SAFETY: as above.
    assert_eq!(unsafe { verbs::ibv_destroy_cq(cq) }, 0);
    // SAFETY: as above.
    assert_eq!(unsafe { verbs::ibv_dealloc_pd(pd) }, 0);
    close_the_device(context, list);
    // Closing ended the event thread and closed the CA.
    assert_eq!(machine.0.user_contexts(), 0);
    drop(buffer);
    shut_down_cleanly(machine);
}
