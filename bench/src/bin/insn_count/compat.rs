//! The `compat-*` workloads: our `libibverbs.so.1`'s data path
//! (`ibverbs-compat`, docs/libibverbs.md) called as a C program's
//! `verbs.h` inlines call it: through the object's context's ops
//! (`qp->context->ops.post_send(qp, wr, &bad_wr)`, `ops.post_recv`,
//! `cq->context->ops.poll_cq`).
//!
//! The library runs on the same deterministic two-HCA host as the plugin
//! workloads, behind its `Machine` seam, so a `compat-*` count minus the
//! matching `plugin-*` count is what the library adds to the plugin's
//! fast path (the work request's conversion, finding the object). The
//! objects are made with the library's own entry points (`ibv_open_device`,
//! `ibv_create_qp`, `ibv_modify_qp`, `ibv_reg_mr` over the program's own
//! buffer, ...).
//!
//! - `compat-post`: one 64-byte inline signaled RC send per call;
//! - `compat-recv`: one receive of one SGE per call;
//! - `compat-poll`: one CQE per call.

use std::ffi::c_int;
use std::ptr::null_mut;
use std::sync::{Arc, OnceLock};

use ibal_user::{DeviceIo, PluginSource};
use ibverbs_abi::{
    IBV_ACCESS_LOCAL_WRITE, IBV_MTU_1024, IBV_QP_ACCESS_FLAGS, IBV_QP_AV, IBV_QP_DEST_QPN,
    IBV_QP_MAX_DEST_RD_ATOMIC, IBV_QP_MAX_QP_RD_ATOMIC, IBV_QP_MIN_RNR_TIMER, IBV_QP_PATH_MTU,
    IBV_QP_PKEY_INDEX, IBV_QP_PORT, IBV_QP_RETRY_CNT, IBV_QP_RNR_RETRY, IBV_QP_RQ_PSN,
    IBV_QP_SQ_PSN, IBV_QP_STATE, IBV_QP_TIMEOUT, IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS,
    IBV_QPT_RC, IBV_SEND_INLINE, IBV_SEND_SIGNALED, IBV_WC_SUCCESS, IBV_WR_SEND, IbvAhAttr,
    IbvContext, IbvContextOps, IbvCq, IbvGid, IbvGlobalRoute, IbvQp, IbvQpAttr, IbvQpCap,
    IbvQpInitAttr, IbvRecvWr, IbvSendWr, IbvSge, IbvWc,
};
use ibverbs_compat::{self as verbs, Machine};
use sim_host::memory::Process;
use sim_shells::user_io::{SimIo, settle};

use super::{INLINE, PER_ROUND, SLOT, World, payload};

/// What a `compat-*` workload counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Measured {
    Post,
    Recv,
    Poll,
}

/// The library's machine: the deterministic two-HCA host and one user
/// process on it, through the same OS seam as the plugin workloads.
struct BenchMachine {
    /// Kept for the process's life: the host the seam reaches.
    _world: World,
    process: Process,
    io: Arc<dyn DeviceIo>,
}

impl Machine for BenchMachine {
    fn io(&self) -> Arc<dyn DeviceIo> {
        Arc::clone(&self.io)
    }
    fn plugin(&self) -> PluginSource {
        PluginSource::Linked
    }
    unsafe fn expose_user_memory(&self, addr: *mut u8, len: usize) -> Result<(), c_int> {
        // SAFETY: the caller promised `expose_user_memory`'s contract,
        // which is `Process::adopt`'s for the program's memory.
        unsafe { self.process.adopt(addr, len) }
            .map(drop)
            .map_err(|_| libc::EFAULT)
    }
    fn release_user_memory(&self, addr: u64, len: usize) -> Result<(), c_int> {
        self.process
            .release_adoption(addr, len)
            .map_err(|_| libc::EBUSY)
    }
}

static MACHINE: OnceLock<Arc<BenchMachine>> = OnceLock::new();

fn boot() -> Result<Arc<dyn Machine>, String> {
    let machine = MACHINE
        .get()
        .ok_or("the workload set its machine up first")?;
    Ok(Arc::clone(machine) as Arc<dyn Machine>)
}

/// The ops of an open context of the library (never closed here).
fn ops(context: *mut IbvContext) -> &'static IbvContextOps {
    // SAFETY: an open context of the library, which stays open for the
    // process's life.
    unsafe { &(*context).ops }
}

/// The context of a live QP of the library (`qp->context`).
fn qp_context(qp: *mut IbvQp) -> *mut IbvContext {
    // SAFETY: a live QP of the library.
    unsafe { (*qp).context }
}

/// The context of a live CQ of the library (`cq->context`).
fn cq_context(cq: *mut IbvCq) -> *mut IbvContext {
    // SAFETY: a live CQ of the library.
    unsafe { (*cq).context }
}

/// One program's post of `wr` to `qp`, as `ibv_post_send`'s inline calls
/// it: what the count of `compat-post` covers.
#[inline(never)]
fn measured_compat_post(qp: *mut IbvQp, wr: &mut IbvSendWr) -> c_int {
    let mut bad = null_mut();
    let post = ops(qp_context(qp)).post_send.expect("ops.post_send");
    // SAFETY: a live QP; a valid one-request list; `bad` is valid for a
    // write.
    unsafe { post(qp, wr, &mut bad) }
}

/// One program's post of receive `wr` to `qp` (`ibv_post_recv`'s inline):
/// what the count of `compat-recv` covers.
#[inline(never)]
fn measured_compat_recv(qp: *mut IbvQp, wr: &mut IbvRecvWr) -> c_int {
    let mut bad = null_mut();
    let post = ops(qp_context(qp)).post_recv.expect("ops.post_recv");
    // SAFETY: as in `measured_compat_post`.
    unsafe { post(qp, wr, &mut bad) }
}

/// One program's poll of one CQE (`ibv_poll_cq`'s inline): what the count
/// of `compat-poll` covers.
#[inline(never)]
fn measured_compat_poll(cq: *mut IbvCq, wc: &mut IbvWc) -> c_int {
    let poll = ops(cq_context(cq)).poll_cq.expect("ops.poll_cq");
    // SAFETY: a live CQ; one completion's room at `wc`.
    unsafe { poll(cq, 1, wc) }
}

/// One side: its context, CQ and RC QP.
struct Side {
    context: *mut IbvContext,
    cq: *mut IbvCq,
    qp: *mut IbvQp,
    gid: IbvGid,
}

fn side(context: *mut IbvContext) -> Side {
    // SAFETY: an open context of the library (each call below checks its
    // pointers against the live objects).
    let pd = unsafe { verbs::ibv_alloc_pd(context) };
    // SAFETY: as above.
    let cq = unsafe { verbs::ibv_create_cq(context, 64, null_mut(), null_mut(), 0) };
    assert!(!pd.is_null() && !cq.is_null());
    let mut init = IbvQpInitAttr {
        qp_context: null_mut(),
        send_cq: cq,
        recv_cq: cq,
        srq: null_mut(),
        cap: IbvQpCap {
            max_send_wr: PER_ROUND as u32 * 2,
            max_recv_wr: PER_ROUND as u32 * 2,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: INLINE as u32,
        },
        qp_type: IBV_QPT_RC,
        sq_sig_all: 0,
    };
    // SAFETY: `init` is valid for reads and writes.
    let qp = unsafe { verbs::ibv_create_qp(pd, &mut init) };
    assert!(!qp.is_null());
    let mut gid = IbvGid { raw: [0; 16] };
    // SAFETY: `gid` is valid for a write.
    assert_eq!(unsafe { verbs::ibv_query_gid(context, 1, 0, &mut gid) }, 0);
    Side {
        context,
        cq,
        qp,
        gid,
    }
}

/// RESET → INIT → RTR → RTS towards `dest`.
fn connect(side: &Side, dest: &Side) {
    let modify = |attr: IbvQpAttr, mask: u32| {
        let mut attr = attr;
        // SAFETY: a live QP of the library and a valid attribute set.
        let done = unsafe { verbs::ibv_modify_qp(side.qp, &mut attr, mask as c_int) };
        assert_eq!(done, 0, "the modify");
    };
    modify(
        IbvQpAttr {
            qp_state: IBV_QPS_INIT,
            port_num: 1,
            ..IbvQpAttr::default()
        },
        IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
    );
    modify(
        IbvQpAttr {
            qp_state: IBV_QPS_RTR,
            path_mtu: IBV_MTU_1024,
            // SAFETY: a live QP of the library.
            dest_qp_num: unsafe { (*dest.qp).qp_num },
            rq_psn: 100,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            ah_attr: IbvAhAttr {
                grh: IbvGlobalRoute {
                    dgid: dest.gid,
                    hop_limit: 64,
                    ..IbvGlobalRoute::default()
                },
                is_global: 1,
                port_num: 1,
                ..IbvAhAttr::default()
            },
            ..IbvQpAttr::default()
        },
        IBV_QP_STATE
            | IBV_QP_AV
            | IBV_QP_PATH_MTU
            | IBV_QP_DEST_QPN
            | IBV_QP_RQ_PSN
            | IBV_QP_MAX_DEST_RD_ATOMIC
            | IBV_QP_MIN_RNR_TIMER,
    );
    modify(
        IbvQpAttr {
            qp_state: IBV_QPS_RTS,
            sq_psn: 100,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 1,
            ..IbvQpAttr::default()
        },
        IBV_QP_STATE
            | IBV_QP_SQ_PSN
            | IBV_QP_TIMEOUT
            | IBV_QP_RETRY_CNT
            | IBV_QP_RNR_RETRY
            | IBV_QP_MAX_QP_RD_ATOMIC,
    );
}

/// A completion with nothing in it (`IbvWc` has no `Default`).
fn empty_wc() -> IbvWc {
    // SAFETY: `IbvWc` is plain integers: all zeroes is a valid value.
    unsafe { std::mem::zeroed() }
}

/// Polls one completion of `cq` (measured or not) and checks it is
/// `wr_id`'s success.
fn poll_one(cq: *mut IbvCq, wr_id: u64, measured: bool) {
    let mut wc = empty_wc();
    let got = if measured {
        measured_compat_poll(cq, &mut wc)
    } else {
        let poll = ops(cq_context(cq)).poll_cq.expect("ops.poll_cq");
        // SAFETY: a live CQ of the library; one completion's room.
        unsafe { poll(cq, 1, &mut wc) }
    };
    assert_eq!(got, 1, "the completion is there");
    assert_eq!((wc.wr_id, wc.status), (wr_id, IBV_WC_SUCCESS));
}

/// RC from HCA 0's QP to HCA 1's, through the library; returns the
/// measured calls.
pub(super) fn compat_workload(rounds: usize, measured: Measured) -> usize {
    let world = World::new(true);
    let process = Process::new(73);
    let io: Arc<dyn DeviceIo> = SimIo::new(&world.host, &process);
    let host = Arc::clone(&world.host);
    assert!(
        MACHINE
            .set(Arc::new(BenchMachine {
                _world: world,
                process,
                io
            }))
            .is_ok()
    );
    assert!(verbs::set_boot(boot), "one workload per process");
    let mut count: c_int = 0;
    // SAFETY: `count` is valid for a write.
    let list = unsafe { verbs::ibv_get_device_list(&mut count) };
    assert_eq!(count, 2, "both HCAs listed");
    // SAFETY: the library's list of `count` devices (and a NULL).
    let devices = unsafe { std::slice::from_raw_parts(list, 2) };
    let contexts: Vec<*mut IbvContext> = devices
        .iter()
        .map(|&d| {
            // SAFETY: a device of the list.
            let context = unsafe { verbs::ibv_open_device(d) };
            assert!(!context.is_null());
            context
        })
        .collect();
    let (sender, receiver) = (side(contexts[0]), side(contexts[1]));
    connect(&sender, &receiver);
    connect(&receiver, &sender);
    // The program's receive buffer, registered by the library.
    let buffer: &'static mut [u8] = Box::leak(vec![0u8; SLOT * PER_ROUND].into_boxed_slice());
    // SAFETY: a live QP of the library.
    let receiver_pd = unsafe { (*receiver.qp).pd };
    // SAFETY: the receiver's PD and the program's own buffer, which lives
    // as long as the process.
    let mr = unsafe {
        verbs::ibv_reg_mr(
            receiver_pd,
            buffer.as_mut_ptr().cast(),
            buffer.len(),
            IBV_ACCESS_LOCAL_WRITE as c_int,
        )
    };
    assert!(!mr.is_null(), "the receive buffer registered");
    // SAFETY: a live region of the library.
    let lkey = unsafe { (*mr).lkey };
    let recv_base = buffer.as_ptr() as u64;
    let mut calls = 0;
    let mut sent = 0;
    for _ in 0..rounds {
        for i in 0..PER_ROUND {
            let mut sge = IbvSge {
                addr: recv_base + (i * SLOT) as u64,
                length: SLOT as u32,
                lkey,
            };
            let mut wr = IbvRecvWr {
                wr_id: (sent + i) as u64,
                next: null_mut(),
                sg_list: &mut sge,
                num_sge: 1,
            };
            let posted = if measured == Measured::Recv {
                calls += 1;
                measured_compat_recv(receiver.qp, &mut wr)
            } else {
                let mut bad = null_mut();
                let post = ops(receiver.context).post_recv.expect("ops.post_recv");
                // SAFETY: a live QP; a valid one-request list.
                unsafe { post(receiver.qp, &mut wr, &mut bad) }
            };
            assert_eq!(posted, 0, "the receive posted");
        }
        for n in sent..sent + PER_ROUND {
            let data = payload(n);
            let mut sge = IbvSge {
                addr: data.as_ptr() as u64,
                length: INLINE as u32,
                lkey: 0,
            };
            // SAFETY: `IbvSendWr` is integers, pointers and unions of
            // them: all zeroes is a valid value (a NULL `next`).
            let mut wr: IbvSendWr = unsafe { std::mem::zeroed() };
            wr.wr_id = n as u64;
            wr.sg_list = &mut sge;
            wr.num_sge = 1;
            wr.opcode = IBV_WR_SEND;
            wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
            let posted = if measured == Measured::Post {
                calls += 1;
                measured_compat_post(sender.qp, &mut wr)
            } else {
                let mut bad = null_mut();
                let post = ops(sender.context).post_send.expect("ops.post_send");
                // SAFETY: a live QP; a valid one-request list.
                unsafe { post(sender.qp, &mut wr, &mut bad) }
            };
            assert_eq!(posted, 0, "the send posted");
        }
        settle(&host);
        for n in sent..sent + PER_ROUND {
            let measure_poll = measured == Measured::Poll;
            calls += usize::from(measure_poll);
            poll_one(sender.cq, n as u64, measure_poll);
            poll_one(receiver.cq, n as u64, false);
            let at = (n - sent) * SLOT;
            assert_eq!(
                buffer[at..at + INLINE],
                payload(n),
                "message {n} arrived whole"
            );
        }
        sent += PER_ROUND;
    }
    calls
}
