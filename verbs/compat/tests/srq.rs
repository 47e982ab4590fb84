//! Shared receive queues, called in-process as a C program calls them, on
//! the embedded simulated machine: `ibv_create_srq` filling the `ibv_srq`
//! and writing the granted sizes back, `ibv_query_srq`, `ibv_modify_srq`
//! arming the limit and refusing a resize, `ops.post_srq_recv` (the
//! `ibv_post_srq_recv` inline's slot) posting up to the depth and
//! refusing the request past it with `*bad_wr`, QPs made on the SRQ
//! (`ibv_post_recv` on them refused), `EBUSY` for the SRQ while a QP
//! uses it and for its PD while it lives, every refusal of a pointer that
//! is not ours, and a clean shutdown. (Receives taken from the SRQ by
//! traffic: `verbs/sim-lib/tests/pingpong.rs`, Debian's
//! `ibv_srq_pingpong` across two processes.)

use std::ffi::c_int;
use std::ptr::null_mut;

use ibverbs_abi::{
    IBV_QPT_RC, IBV_QPT_UD, IBV_SRQ_LIMIT, IBV_SRQ_MAX_WR, IbvCq, IbvPd, IbvQpAttr, IbvQpCap,
    IbvQpInitAttr, IbvRecvWr, IbvSge, IbvSrq, IbvSrqAttr, IbvSrqInitAttr,
};
use ibverbs_compat::{self as verbs};

mod support;
use support::*;

/// The SRQ's depth asked for (the device rounds up to a power of two).
const DEPTH: u32 = 8;

fn create_srq(
    pd: *mut IbvPd,
    max_wr: u32,
    max_sge: u32,
    srq_limit: u32,
) -> (*mut IbvSrq, IbvSrqAttr) {
    let mut init = IbvSrqInitAttr {
        srq_context: 0x5151 as *mut _,
        attr: IbvSrqAttr {
            max_wr,
            max_sge,
            srq_limit,
        },
    };
    // SAFETY: `init` is valid; the PD is checked.
    let srq = unsafe { verbs::ibv_create_srq(pd, &mut init) };
    (srq, init.attr)
}

fn query_srq(srq: *mut IbvSrq) -> Result<IbvSrqAttr, c_int> {
    let mut attr = IbvSrqAttr::default();
    // SAFETY: `attr` is valid for a write; the SRQ is checked.
    match unsafe { verbs::ibv_query_srq(srq, &mut attr) } {
        0 => Ok(attr),
        errno => Err(errno),
    }
}

fn modify_srq(srq: *mut IbvSrq, attr: IbvSrqAttr, mask: u32) -> c_int {
    let mut attr = attr;
    // SAFETY: `attr` is valid; the SRQ is checked.
    unsafe { verbs::ibv_modify_srq(srq, &mut attr, mask as c_int) }
}

fn qp_init(cq: *mut IbvCq, srq: *mut IbvSrq, qp_type: u32) -> IbvQpInitAttr {
    IbvQpInitAttr {
        qp_context: null_mut(),
        send_cq: cq,
        recv_cq: cq,
        srq,
        // Receive capacities asked for on an SRQ are ignored (rdma-core's
        // providers ignore them).
        cap: IbvQpCap {
            max_send_wr: 2,
            max_recv_wr: 16,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        qp_type,
        sq_sig_all: 0,
    }
}

/// Receive requests with no scatter entries, chained in order.
fn chain(requests: &mut [IbvRecvWr]) {
    for at in 1..requests.len() {
        let next = std::ptr::from_mut(&mut requests[at]);
        requests[at - 1].next = next;
    }
}

fn receives(count: usize, first_id: u64) -> Vec<IbvRecvWr> {
    (0..count)
        .map(|i| IbvRecvWr {
            wr_id: first_id + i as u64,
            next: null_mut(),
            sg_list: null_mut(),
            num_sge: 0,
        })
        .collect()
}

#[test]
fn shared_receive_queues_their_verbs_qps_on_them_and_every_refusal() {
    let (list, context) = open_the_device(boot);
    let machine = MACHINE.get().unwrap();
    // SAFETY: checked against the open contexts.
    let pd = unsafe { verbs::ibv_alloc_pd(context) };
    // SAFETY: as above.
    let other_pd = unsafe { verbs::ibv_alloc_pd(context) };
    // SAFETY: as above.
    let cq = unsafe { verbs::ibv_create_cq(context, 16, null_mut(), null_mut(), 0) };
    assert!(!pd.is_null() && !other_pd.is_null() && !cq.is_null());

    // Creation: the limit asked is ignored (rdma-core: "irrelevant" at
    // create), the granted sizes written back, the `ibv_srq` filled.
    let (srq, granted) = create_srq(pd, DEPTH - 1, 1, 3);
    assert!(!srq.is_null(), "errno {}", errno());
    assert_eq!(
        (granted.max_wr, granted.max_sge, granted.srq_limit),
        (DEPTH, 1, 3),
        "rounded up to a power of two; the limit field left as given"
    );
    // SAFETY: a live SRQ of ours.
    let raw = unsafe { &*srq };
    assert_eq!((raw.context, raw.pd), (context, pd));
    assert_eq!(raw.srq_context, 0x5151 as *mut _);
    assert_eq!(
        query_srq(srq),
        Ok(IbvSrqAttr {
            max_wr: DEPTH,
            max_sge: 1,
            srq_limit: 0
        }),
        "not armed at creation"
    );
    // Refused creations: no receives, more than the device holds, a PD
    // that is not ours, NULL attributes.
    clear_errno();
    assert!(create_srq(pd, 0, 1, 0).0.is_null());
    assert_eq!(errno(), libc::EINVAL);
    assert!(create_srq(pd, 1 << 30, 1, 0).0.is_null());
    assert_eq!(errno(), libc::EINVAL);
    assert!(create_srq(pd, 4, 1 << 20, 0).0.is_null());
    assert_eq!(errno(), libc::EINVAL);
    assert!(create_srq(cq.cast(), 4, 1, 0).0.is_null());
    assert_eq!(errno(), libc::EINVAL);
    // SAFETY: a NULL attribute pointer is checked.
    assert!(unsafe { verbs::ibv_create_srq(pd, null_mut()) }.is_null());
    assert_eq!(errno(), libc::EINVAL);

    // Modify: the limit armed (and read back), a resize refused changing
    // nothing, a limit above the depth, unknown bits, NULL attributes.
    let limit = |srq_limit| IbvSrqAttr {
        max_wr: 0,
        max_sge: 0,
        srq_limit,
    };
    assert_eq!(modify_srq(srq, limit(3), IBV_SRQ_LIMIT), 0);
    assert_eq!(query_srq(srq).map(|a| a.srq_limit), Ok(3));
    let resize = IbvSrqAttr {
        max_wr: 2 * DEPTH,
        max_sge: 0,
        srq_limit: 5,
    };
    assert_eq!(
        modify_srq(srq, resize, IBV_SRQ_MAX_WR | IBV_SRQ_LIMIT),
        libc::EOPNOTSUPP
    );
    assert_eq!(modify_srq(srq, resize, IBV_SRQ_MAX_WR), libc::EOPNOTSUPP);
    assert_eq!(
        query_srq(srq).map(|a| (a.max_wr, a.srq_limit)),
        Ok((DEPTH, 3)),
        "a refused modify changes nothing"
    );
    assert_eq!(
        modify_srq(srq, limit(DEPTH + 1), IBV_SRQ_LIMIT),
        libc::EINVAL
    );
    assert_eq!(modify_srq(srq, limit(1), 1 << 2), libc::EINVAL);
    // SAFETY: a NULL attribute pointer is checked.
    let no_attr = unsafe { verbs::ibv_modify_srq(srq, null_mut(), IBV_SRQ_LIMIT as c_int) };
    assert_eq!(no_attr, libc::EINVAL);
    assert_eq!(modify_srq(srq, limit(0), IBV_SRQ_LIMIT), 0, "disarmed");
    assert_eq!(query_srq(srq).map(|a| a.srq_limit), Ok(0));
    // SAFETY: a NULL out-pointer is checked.
    let no_out = unsafe { verbs::ibv_query_srq(srq, null_mut()) };
    assert_eq!(no_out, libc::EINVAL);

    // `ibv_get_srq_num` (XRC) is not offered: its slot is NULL, so the
    // inline answers EOPNOTSUPP.
    let verbs_context = context
        .cast::<u8>()
        .wrapping_sub(std::mem::offset_of!(ibverbs_abi::VerbsContext, context))
        .cast::<ibverbs_abi::VerbsContext>();
    // SAFETY: our context ends a `verbs_context` (the library's layout).
    assert!(unsafe { (*verbs_context).get_srq_num }.is_none());

    // QPs on the SRQ: `srq` set, no receive capacity of their own,
    // `ibv_post_recv` refused. An SRQ of another PD, or not ours, refused.
    let mut rc_init = qp_init(cq, srq, IBV_QPT_RC);
    // SAFETY: `rc_init` is valid; the objects are checked.
    let rc = unsafe { verbs::ibv_create_qp(pd, &mut rc_init) };
    assert!(!rc.is_null(), "errno {}", errno());
    assert_eq!(
        (rc_init.cap.max_recv_wr, rc_init.cap.max_recv_sge),
        (0, 0),
        "no receive queue of its own"
    );
    let mut ud_init = qp_init(cq, srq, IBV_QPT_UD);
    // SAFETY: as above.
    let ud = unsafe { verbs::ibv_create_qp(pd, &mut ud_init) };
    assert!(!ud.is_null(), "errno {}", errno());
    // SAFETY: a live QP of ours.
    let rc_srq = unsafe { (*rc).srq };
    // SAFETY: as above.
    let ud_srq = unsafe { (*ud).srq };
    assert_eq!((rc_srq, ud_srq), (srq, srq));
    let (mut queried, mut queried_init) = (IbvQpAttr::default(), qp_init(cq, null_mut(), 0));
    assert_eq!(
        // SAFETY: valid out-pointers.
        unsafe { verbs::ibv_query_qp(rc, &mut queried, 0, &mut queried_init) },
        0
    );
    assert_eq!(queried_init.srq, srq);
    let mut wrong_pd = qp_init(cq, srq, IBV_QPT_RC);
    // SAFETY: as above.
    assert!(unsafe { verbs::ibv_create_qp(other_pd, &mut wrong_pd) }.is_null());
    assert_eq!(errno(), libc::EINVAL);
    let mut foreign_srq = qp_init(cq, cq.cast(), IBV_QPT_RC);
    // SAFETY: as above.
    assert!(unsafe { verbs::ibv_create_qp(pd, &mut foreign_srq) }.is_null());
    assert_eq!(errno(), libc::EINVAL);
    // SAFETY: the QP's context is the open context.
    let post_recv = unsafe { (*context).ops.post_recv }.expect("ops.post_recv set");
    let mut on_qp = receives(1, 7);
    let mut bad = null_mut();
    // SAFETY: a valid list and out-pointer.
    let on_srq_qp = unsafe { post_recv(rc, on_qp.as_mut_ptr(), &mut bad) };
    assert_eq!(on_srq_qp, libc::EINVAL);
    assert_eq!(bad, on_qp.as_mut_ptr(), "*bad_wr the first");

    // Posting: the inline's slot is set; a request with more entries than
    // the SRQ holds, or a negative count, refused and named; the depth's
    // worth posted, the one past it refused (a full queue, ENOMEM) and
    // named, the ones before it posted.
    // SAFETY: the SRQ's context is the open context.
    let post_srq_recv = unsafe { (*context).ops.post_srq_recv }.expect("ops.post_srq_recv set");
    let post = |requests: &mut [IbvRecvWr], bad: &mut *mut IbvRecvWr| {
        chain(requests);
        // SAFETY: a valid list and out-pointer; the SRQ is checked.
        unsafe { post_srq_recv(srq, requests.as_mut_ptr(), bad) }
    };
    let mut sges = [IbvSge::default(); 2];
    let mut too_many = receives(1, 90);
    too_many[0].sg_list = sges.as_mut_ptr();
    too_many[0].num_sge = 2;
    assert_eq!(post(&mut too_many, &mut bad), libc::EINVAL);
    assert_eq!(bad, too_many.as_mut_ptr());
    let mut negative = receives(2, 95);
    negative[1].num_sge = -1;
    bad = null_mut();
    assert_eq!(post(&mut negative, &mut bad), libc::EINVAL);
    assert_eq!(bad, std::ptr::from_mut(&mut negative[1]), "the second");
    // The first of `negative` was posted: DEPTH - 1 more fit, then none.
    let mut fill = receives(DEPTH as usize, 100);
    bad = null_mut();
    assert_eq!(post(&mut fill, &mut bad), libc::ENOMEM);
    assert_eq!(
        bad,
        std::ptr::from_mut(&mut fill[DEPTH as usize - 1]),
        "the one past the depth"
    );
    let mut one_more = receives(1, 200);
    assert_eq!(post(&mut one_more, &mut bad), libc::ENOMEM);
    assert_eq!(bad, one_more.as_mut_ptr());
    let mut strangers = receives(1, 300);
    // SAFETY: a valid list; the SRQ pointer is checked.
    let refused = unsafe { post_srq_recv(cq.cast(), strangers.as_mut_ptr(), &mut bad) };
    assert_eq!((refused, bad), (libc::EINVAL, strangers.as_mut_ptr()));

    // Destroys: the SRQ is busy while its QPs live, its PD while it lives;
    // each destroy once; pointers not ours refused.
    // SAFETY: checked against the live objects.
    assert_eq!(unsafe { verbs::ibv_destroy_srq(srq) }, libc::EBUSY);
    // SAFETY: as above.
    assert_eq!(unsafe { verbs::ibv_destroy_qp(rc) }, 0);
    // SAFETY: as above.
    let ud_left = unsafe { verbs::ibv_destroy_srq(srq) };
    assert_eq!(ud_left, libc::EBUSY, "the UD QP is left");
    // SAFETY: as above.
    assert_eq!(unsafe { verbs::ibv_destroy_qp(ud) }, 0);
    // SAFETY: as above.
    assert_eq!(unsafe { verbs::ibv_dealloc_pd(pd) }, libc::EBUSY);
    // SAFETY: as above.
    assert_eq!(unsafe { verbs::ibv_destroy_srq(srq) }, 0);
    // SAFETY: as above.
    assert_eq!(unsafe { verbs::ibv_destroy_srq(srq) }, libc::EINVAL);
    // SAFETY: as above.
    assert_eq!(unsafe { verbs::ibv_destroy_srq(null_mut()) }, libc::EINVAL);
    assert_eq!(query_srq(srq), Err(libc::EINVAL));
    assert_eq!(modify_srq(srq, limit(1), IBV_SRQ_LIMIT), libc::EINVAL);
    // SAFETY: as above.
    assert_eq!(unsafe { verbs::ibv_dealloc_pd(pd) }, 0);
    // SAFETY: as above.
    assert_eq!(unsafe { verbs::ibv_dealloc_pd(other_pd) }, 0);
    // SAFETY: as above.
    assert_eq!(unsafe { verbs::ibv_destroy_cq(cq) }, 0);
    close_the_device(context, list);
    shut_down_cleanly(machine);
}
