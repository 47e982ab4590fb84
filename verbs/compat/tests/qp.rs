//! Queue pairs, called in-process as a C program calls them, on the
//! embedded simulated machine: `ibv_create_qp` filling the `ibv_qp` and
//! writing the granted capacities back, `ibv_modify_qp`'s mask and its
//! refusals (perftest's send INIT: region-only rights in the access flags
//! accepted and ignored), `qp->state` following, `ibv_query_qp`, `ops.post_recv`
//! setting `*bad_wr` to the first malformed request with those before it
//! posted (seen flushed when the QP enters the error state), `EBUSY` for
//! the PD and CQ while the QP lives, and a clean shutdown.

use std::ffi::c_int;
use std::ptr::null_mut;
use std::time::Duration;

use ibverbs_abi::{
    IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_MW_BIND, IBV_ACCESS_REMOTE_WRITE, IBV_QP_ACCESS_FLAGS,
    IBV_QP_PKEY_INDEX, IBV_QP_PORT, IBV_QP_RATE_LIMIT, IBV_QP_STATE, IBV_QPS_ERR, IBV_QPS_INIT,
    IBV_QPS_RESET, IBV_QPT_RC, IBV_WC_RECV, IBV_WC_WR_FLUSH_ERR, IbvQpAttr, IbvQpInitAttr,
    IbvRecvWr, IbvSge, IbvWc,
};
use ibverbs_compat::{self as verbs};

mod support;
use support::*;

#[test]
fn queue_pairs_modify_query_and_post_recv_with_bad_wr() {
    let (list, context) = open_the_device(boot);
    let machine = MACHINE.get().unwrap();
    let (pd, cq) = pd_and_cq(context, 16);

    let mut init = qp_init_attr(cq, IBV_QPT_RC, 4);
    // SAFETY: `init` is valid; the PD and CQs are checked.
    let qp = unsafe { verbs::ibv_create_qp(pd, &mut init) };
    assert!(!qp.is_null(), "errno {}", errno());
    // SAFETY: a live QP of ours.
    let raw = unsafe { &*qp };
    assert_eq!(
        (raw.context, raw.pd, raw.send_cq, raw.recv_cq),
        (context, pd, cq, cq)
    );
    assert_eq!((raw.state, raw.qp_type), (IBV_QPS_RESET, IBV_QPT_RC));
    assert_ne!(raw.qp_num, 0);
    assert!(init.cap.max_recv_wr >= 4, "granted capacities written back");
    let mut bad_init = IbvQpInitAttr {
        qp_type: 99,
        ..init
    };
    // SAFETY: as above.
    assert!(unsafe { verbs::ibv_create_qp(pd, &mut bad_init) }.is_null());
    assert_eq!(errno(), libc::EOPNOTSUPP);
    let mut foreign_cq = IbvQpInitAttr {
        send_cq: pd.cast(),
        ..init
    };
    // SAFETY: as above.
    assert!(unsafe { verbs::ibv_create_qp(pd, &mut foreign_cq) }.is_null());
    assert_eq!(errno(), libc::EINVAL);
    // SAFETY: checked against the live objects.
    assert_eq!(unsafe { verbs::ibv_dealloc_pd(pd) }, libc::EBUSY);
    // SAFETY: as above.
    assert_eq!(unsafe { verbs::ibv_destroy_cq(cq) }, libc::EBUSY);

    // RESET -> INIT as perftest's send tests ask (mask 0x39, access
    // LOCAL_WRITE | REMOTE_WRITE); refusals first.
    let modify = |attr: &mut IbvQpAttr, mask: u32| {
        // SAFETY: `attr` is valid; the QP is checked.
        unsafe { verbs::ibv_modify_qp(qp, attr, mask as c_int) }
    };
    let mut attr = IbvQpAttr {
        qp_state: IBV_QPS_INIT,
        port_num: 1,
        qp_access_flags: IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE,
        ..IbvQpAttr::default()
    };
    let init_mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
    assert_eq!(init_mask, 0x39, "perftest's mask");
    let mut unknown_access = IbvQpAttr {
        qp_access_flags: 1 << 31,
        ..attr
    };
    assert_eq!(modify(&mut unknown_access, init_mask), libc::EINVAL);
    assert_eq!(
        modify(&mut attr, init_mask | IBV_QP_RATE_LIMIT),
        libc::EOPNOTSUPP
    );
    let mut bad_state = IbvQpAttr {
        qp_state: 42,
        ..attr
    };
    assert_eq!(modify(&mut bad_state, init_mask), libc::EINVAL);
    assert_eq!(
        // SAFETY: a live QP of ours.
        unsafe { (*qp).state },
        IBV_QPS_RESET,
        "a refused modify changes nothing"
    );
    assert_eq!(modify(&mut attr, init_mask), 0);
    // SAFETY: a live QP of ours (its state written by the modify).
    assert_eq!(unsafe { (*qp).state }, IBV_QPS_INIT);
    let (mut queried, mut queried_init) = (IbvQpAttr::default(), init);
    assert_eq!(
        // SAFETY: valid out-pointers.
        unsafe { verbs::ibv_query_qp(qp, &mut queried, 0, &mut queried_init) },
        0
    );
    assert_eq!((queried.qp_state, queried.port_num), (IBV_QPS_INIT, 1));
    assert_eq!(
        queried.qp_access_flags, IBV_ACCESS_REMOTE_WRITE,
        "a QP's rights are the remote ones; LOCAL_WRITE is accepted and ignored"
    );
    // MW_BIND, another region-only right, is accepted and ignored as well.
    let mut mw_bind = IbvQpAttr {
        qp_access_flags: IBV_ACCESS_MW_BIND | IBV_ACCESS_REMOTE_WRITE,
        ..IbvQpAttr::default()
    };
    assert_eq!(modify(&mut mw_bind, IBV_QP_ACCESS_FLAGS), 0);
    assert_eq!(queried_init.cap, init.cap);

    // Two receives, the second malformed: *bad_wr names it, the first is
    // posted (it is flushed when the QP enters the error state).
    let buffer = [0u8; 64];
    let mut sge = IbvSge {
        addr: buffer.as_ptr() as u64,
        length: 0,
        lkey: 0,
    };
    let mut second = IbvRecvWr {
        wr_id: 2,
        next: null_mut(),
        sg_list: &mut sge,
        num_sge: -1,
    };
    let mut first = IbvRecvWr {
        wr_id: 1,
        next: &mut second,
        sg_list: &mut sge,
        num_sge: 0,
    };
    // SAFETY: the QP's context is the open context.
    let post_recv = unsafe { (*context).ops.post_recv }.expect("ops.post_recv set");
    let mut bad = null_mut();
    // SAFETY: a valid list and out-pointer.
    assert_eq!(unsafe { post_recv(qp, &mut first, &mut bad) }, libc::EINVAL);
    assert_eq!(bad, std::ptr::from_mut(&mut second));
    let mut to_error = IbvQpAttr {
        qp_state: IBV_QPS_ERR,
        ..IbvQpAttr::default()
    };
    assert_eq!(modify(&mut to_error, IBV_QP_STATE), 0);
    // SAFETY: the CQ's context is the open context.
    let poll_cq = unsafe { (*context).ops.poll_cq }.expect("ops.poll_cq set");
    let mut wc = [IbvWc::default(); 4];
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let got = loop {
        // SAFETY: `wc` holds 4 entries.
        let got = unsafe { poll_cq(cq, 4, wc.as_mut_ptr()) };
        if got != 0 || std::time::Instant::now() > deadline {
            break got;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(got, 1, "exactly the first receive was posted");
    assert_eq!(
        (wc[0].wr_id, wc[0].status, wc[0].opcode),
        (1, IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV)
    );

    // SAFETY: checked against the live objects.
    assert_eq!(unsafe { verbs::ibv_destroy_qp(qp) }, 0);
    // SAFETY: as above.
    assert_eq!(unsafe { verbs::ibv_destroy_qp(qp) }, libc::EINVAL);
    // SAFETY: as above.
    assert_eq!(unsafe { verbs::ibv_destroy_cq(cq) }, 0);
    // SAFETY: as above.
    assert_eq!(unsafe { verbs::ibv_dealloc_pd(pd) }, 0);
    close_the_device(context, list);
    shut_down_cleanly(machine);
}
