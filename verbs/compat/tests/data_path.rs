//! The data path (`ops.post_send`, `ops.post_recv`, `ops.post_srq_recv`,
//! `ops.poll_cq`, `ops.req_notify_cq`), called in-process as a C program's `verbs.h`
//! inlines call it, on the embedded simulated machine: it allocates
//! nothing (each call's allocations on the calling thread are counted,
//! the doorbell's simulated device deferred until after the count); a
//! destroyed object's pointer and a pointer that is not ours are refused;
//! and posts and polls racing a destroy from several threads end cleanly,
//! every one after the destroy refused; a UD send finds its address
//! handle by the pointer, a destroyed handle refused; a long list's
//! refusal names its request across the chunks it is posted in.

use std::cell::Cell;
use std::ffi::c_int;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use ibal_user::{DeviceFile, DeviceIo, DevicePath, OsStatus, PluginSource};
use ibverbs_abi::{
    IBV_ACCESS_LOCAL_WRITE, IBV_MTU_1024, IBV_QP_ACCESS_FLAGS, IBV_QP_AV, IBV_QP_DEST_QPN,
    IBV_QP_MAX_DEST_RD_ATOMIC, IBV_QP_MAX_QP_RD_ATOMIC, IBV_QP_MIN_RNR_TIMER, IBV_QP_PATH_MTU,
    IBV_QP_PKEY_INDEX, IBV_QP_PORT, IBV_QP_QKEY, IBV_QP_RETRY_CNT, IBV_QP_RNR_RETRY, IBV_QP_RQ_PSN,
    IBV_QP_SQ_PSN, IBV_QP_STATE, IBV_QP_TIMEOUT, IBV_QPS_ERR, IBV_QPS_INIT, IBV_QPS_RTR,
    IBV_QPS_RTS, IBV_QPT_RC, IBV_QPT_UD, IBV_SEND_INLINE, IBV_SEND_SIGNALED, IBV_WR_SEND,
    IbvAhAttr, IbvContext, IbvContextOps, IbvCq, IbvGid, IbvGlobalRoute, IbvMr, IbvPd, IbvQp,
    IbvQpAttr, IbvQpCap, IbvQpInitAttr, IbvRecvWr, IbvSendWr, IbvSendWrUd, IbvSge, IbvSrqAttr,
    IbvSrqInitAttr, IbvWc,
};
use ibverbs_compat::{self as verbs, Machine};
use sim_shells::embedded::{EmbeddedMachine, Fabric};

sim_host::install_driver_heap_check!();

thread_local! {
    /// True while [`allocations_of`] runs its call on this thread.
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    /// A doorbell stored while counting: delivered after the count, so the
    /// simulated device's work (which runs in the storing thread) is not
    /// counted as the library's. Only the last is kept: it carries the
    /// queue's producer counter, which covers the ones before.
    static DEFERRED: Cell<Option<(u64, u64)>> = const { Cell::new(None) };
}

/// A doorbell store's destination (`uvp_plugin::mmio::MmioHook`).
type DoorbellHook = Arc<dyn Fn(u64, u64) + Send + Sync>;

/// The embedded machine's own doorbell hook: where a deferred store goes.
static DEVICE_DOORBELL: OnceLock<DoorbellHook> = OnceLock::new();

/// The embedded machine's OS seam, with the doorbells stored while
/// counting deferred.
#[derive(Debug)]
struct DeferringIo(Arc<dyn DeviceIo>);

impl DeviceIo for DeferringIo {
    fn interface_paths(&self) -> Result<Vec<DevicePath>, OsStatus> {
        self.0.interface_paths()
    }
    fn open(&self, path: &DevicePath) -> Result<Box<dyn DeviceFile>, OsStatus> {
        self.0.open(path)
    }
    fn alloc(&self, len: usize) -> Result<u64, OsStatus> {
        self.0.alloc(len)
    }
    fn free(&self, va: u64) {
        self.0.free(va);
    }
    fn read(&self, va: u64, out: &mut [u8]) -> Result<(), OsStatus> {
        self.0.read(va, out)
    }
    fn write(&self, va: u64, data: &[u8]) -> Result<(), OsStatus> {
        self.0.write(va, data)
    }
    fn doorbell_hook(&self) -> DoorbellHook {
        let device = Arc::clone(DEVICE_DOORBELL.get_or_init(|| self.0.doorbell_hook()));
        Arc::new(move |address, value| {
            if COUNTING.with(Cell::get) {
                DEFERRED.with(|d| d.set(Some((address, value))));
            } else {
                device(address, value);
            }
        })
    }
}

struct TestMachine {
    embedded: EmbeddedMachine,
    io: Arc<dyn DeviceIo>,
}

impl Machine for TestMachine {
    fn io(&self) -> Arc<dyn DeviceIo> {
        Arc::clone(&self.io)
    }
    fn plugin(&self) -> PluginSource {
        PluginSource::Linked
    }
    unsafe fn expose_user_memory(&self, addr: *mut u8, len: usize) -> Result<(), c_int> {
        // SAFETY: the caller promised `expose_user_memory`'s contract,
        // which is `Process::adopt`'s for the program's memory.
        unsafe { self.embedded.adopt_user_memory(addr, len) }
            .map(drop)
            .map_err(|_| libc::EFAULT)
    }
    fn release_user_memory(&self, addr: u64, len: usize) -> Result<(), c_int> {
        self.embedded
            .release_user_memory(addr, len)
            .map_err(|_| libc::EBUSY)
    }
}

fn boot() -> Result<Arc<dyn Machine>, String> {
    let embedded = EmbeddedMachine::boot(Fabric::DEFAULT, 9)?;
    let io: Arc<dyn DeviceIo> = Arc::new(DeferringIo(embedded.io()));
    Ok(Arc::new(TestMachine { embedded, io }))
}

/// The one open context of the test process (every test shares it).
fn context() -> *mut IbvContext {
    static CONTEXT: OnceLock<usize> = OnceLock::new();
    let address = *CONTEXT.get_or_init(|| {
        verbs::set_boot(boot);
        let mut count: c_int = 0;
        // SAFETY: `count` is valid for a write.
        let list = unsafe { verbs::ibv_get_device_list(&mut count) };
        assert_eq!(count, 1);
        // SAFETY: a list of one device.
        let device = unsafe { *list };
        // SAFETY: a device of the list.
        let context = unsafe { verbs::ibv_open_device(device) };
        assert!(!context.is_null());
        context as usize
    });
    address as *mut IbvContext
}

fn ops() -> &'static IbvContextOps {
    // SAFETY: the open context, never closed.
    unsafe { &(*context()).ops }
}

/// Allocations `call` makes on this thread (its doorbell deferred), and
/// its result; then the deferred doorbell reaches the device.
fn allocations_of<R>(call: impl FnOnce() -> R) -> (u64, R) {
    assert!(sim_host::alloc_hook::is_installed());
    COUNTING.with(|on| on.set(true));
    let before = sim_host::alloc_hook::thread_allocations();
    let result = call();
    let made = sim_host::alloc_hook::thread_allocations() - before;
    COUNTING.with(|on| on.set(false));
    if let Some((address, value)) = DEFERRED.with(Cell::take) {
        let device = DEVICE_DOORBELL.get().expect("the plugin took the hook");
        device(address, value);
    }
    (made, result)
}

/// A PD, a CQ of 64 and an RC QP (`depth` each way, two SGEs, 64 bytes
/// inline) in INIT.
struct Objects {
    pd: *mut IbvPd,
    cq: *mut IbvCq,
    qp: *mut IbvQp,
}

fn objects(depth: u32) -> Objects {
    let o = created(IBV_QPT_RC, depth, 2);
    modify(
        o.qp,
        IbvQpAttr {
            qp_state: IBV_QPS_INIT,
            port_num: 1,
            ..IbvQpAttr::default()
        },
        IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
    );
    o
}

/// A PD, a CQ of 64 and a QP of `qp_type` (`depth` each way, `sges` SGEs,
/// 64 bytes inline) in RESET.
fn created(qp_type: u32, depth: u32, sges: u32) -> Objects {
    let context = context();
    // SAFETY: the open context.
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
            max_send_wr: depth,
            max_recv_wr: depth,
            max_send_sge: sges,
            max_recv_sge: sges,
            max_inline_data: 64,
        },
        qp_type,
        sq_sig_all: 0,
    };
    // SAFETY: `init` is valid; the PD and CQ are ours.
    let qp = unsafe { verbs::ibv_create_qp(pd, &mut init) };
    assert!(!qp.is_null());
    Objects { pd, cq, qp }
}

fn modify(qp: *mut IbvQp, attr: IbvQpAttr, mask: u32) {
    let mut attr = attr;
    // SAFETY: a QP of ours and a valid attribute set.
    let done = unsafe { verbs::ibv_modify_qp(qp, &mut attr, mask as c_int) };
    assert_eq!(done, 0);
}

/// The address vector of port 1's own GID 0 (the port reaching itself).
fn own_port() -> IbvAhAttr {
    let mut gid = IbvGid { raw: [0; 16] };
    // SAFETY: the open context; `gid` is valid for a write.
    let queried = unsafe { verbs::ibv_query_gid(context(), 1, 0, &mut gid) };
    assert_eq!(queried, 0);
    IbvAhAttr {
        grh: IbvGlobalRoute {
            dgid: gid,
            hop_limit: 64,
            ..IbvGlobalRoute::default()
        },
        is_global: 1,
        port_num: 1,
        ..IbvAhAttr::default()
    }
}

/// Moves `qp` to the error state (what it holds is flushed).
fn to_error(qp: *mut IbvQp) {
    modify(
        qp,
        IbvQpAttr {
            qp_state: IBV_QPS_ERR,
            ..IbvQpAttr::default()
        },
        IBV_QP_STATE,
    );
}

/// INIT → RTR → RTS, connected to itself (its sends go nowhere: only the
/// posts matter here).
fn to_rts(qp: *mut IbvQp) {
    // SAFETY: a live QP of ours.
    let qpn = unsafe { (*qp).qp_num };
    modify(
        qp,
        IbvQpAttr {
            qp_state: IBV_QPS_RTR,
            path_mtu: IBV_MTU_1024,
            dest_qp_num: qpn,
            rq_psn: 1,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            ah_attr: own_port(),
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
        qp,
        IbvQpAttr {
            qp_state: IBV_QPS_RTS,
            sq_psn: 1,
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

/// An SGE of `length` bytes at the start of a registered 4 KiB buffer
/// (the program's own memory), and its region.
fn registered_sge(pd: *mut IbvPd, length: u32) -> (IbvSge, *mut IbvMr) {
    let (buffer, mr) = registered(pd, 4096);
    // SAFETY: a live region of ours.
    let lkey = unsafe { (*mr).lkey };
    let sge = IbvSge {
        addr: buffer.as_ptr() as u64,
        length,
        lkey,
    };
    (sge, mr)
}

/// A registered buffer of `len` bytes (the program's own memory).
fn registered(pd: *mut IbvPd, len: usize) -> (&'static mut [u8], *mut IbvMr) {
    let buffer: &'static mut [u8] = Box::leak(vec![0u8; len].into_boxed_slice());
    // SAFETY: a PD of ours and the program's buffer, alive for the process.
    let mr = unsafe {
        verbs::ibv_reg_mr(
            pd,
            buffer.as_mut_ptr().cast(),
            len,
            IBV_ACCESS_LOCAL_WRITE as c_int,
        )
    };
    assert!(!mr.is_null());
    (buffer, mr)
}

fn post_recv(qp: *mut IbvQp, wr: &mut IbvRecvWr, bad: &mut *mut IbvRecvWr) -> c_int {
    let post = ops().post_recv.expect("ops.post_recv");
    // SAFETY: a valid list and out-pointer; the QP is checked.
    unsafe { post(qp, wr, bad) }
}

fn post_send(qp: *mut IbvQp, wr: &mut IbvSendWr, bad: &mut *mut IbvSendWr) -> c_int {
    let post = ops().post_send.expect("ops.post_send");
    // SAFETY: a valid list and out-pointer; the QP is checked.
    unsafe { post(qp, wr, bad) }
}

fn poll(cq: *mut IbvCq, wc: &mut [IbvWc]) -> c_int {
    let poll = ops().poll_cq.expect("ops.poll_cq");
    // SAFETY: `wc` has room for its length; the CQ is checked.
    unsafe { poll(cq, wc.len() as c_int, wc.as_mut_ptr()) }
}

fn arm(cq: *mut IbvCq) -> c_int {
    let arm = ops().req_notify_cq.expect("ops.req_notify_cq");
    // SAFETY: the CQ is checked.
    unsafe { arm(cq, 0) }
}

/// A receive request to fill in (`recv_list`).
const UNSET_RECV: IbvRecvWr = IbvRecvWr {
    wr_id: 0,
    next: null_mut(),
    sg_list: null_mut(),
    num_sge: 0,
};

/// `count` receive requests chained in `wrs`, each of the SGE at `sge`.
fn recv_list(wrs: &mut [IbvRecvWr], sge: &mut IbvSge, first_id: u64) {
    let count = wrs.len();
    for (i, wr) in wrs.iter_mut().enumerate() {
        *wr = IbvRecvWr {
            wr_id: first_id + i as u64,
            next: null_mut(),
            sg_list: sge,
            num_sge: 1,
        };
    }
    for i in (1..count).rev() {
        let next: *mut IbvRecvWr = &mut wrs[i];
        wrs[i - 1].next = next;
    }
}

/// An inline send of `sges` (zeroed request otherwise).
fn inline_send(wr_id: u64, sges: &mut [IbvSge]) -> IbvSendWr {
    // SAFETY: `IbvSendWr` is integers, pointers and unions of them: all
    // zeroes is a valid value.
    let mut wr: IbvSendWr = unsafe { std::mem::zeroed() };
    wr.wr_id = wr_id;
    wr.sg_list = sges.as_mut_ptr();
    wr.num_sge = sges.len() as c_int;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
    wr
}

/// Posts (one request and lists longer than the library converts at
/// once), polls with a CQE and arms allocate nothing; each call's result
/// is the expected one.
#[test]
fn posts_polls_and_arms_allocate_nothing() {
    let o = objects(64);
    let (mut recv_sge, _) = registered_sge(o.pd, 256);
    let mut bad = null_mut();
    // Warm-up: anything made once per thread or process on first use.
    let mut wrs = [UNSET_RECV; 40];
    recv_list(&mut wrs[..1], &mut recv_sge, 0);
    assert_eq!(post_recv(o.qp, &mut wrs[0], &mut bad), 0);

    recv_list(&mut wrs[..1], &mut recv_sge, 1);
    let (made, posted) = allocations_of(|| post_recv(o.qp, &mut wrs[0], &mut bad));
    assert_eq!((made, posted), (0, 0), "one receive");
    recv_list(&mut wrs[..40], &mut recv_sge, 2);
    let (made, posted) = allocations_of(|| post_recv(o.qp, &mut wrs[0], &mut bad));
    assert_eq!((made, posted), (0, 0), "a list of 40 receives");
    assert_eq!(arm(o.cq), 0);
    let (made, armed) = allocations_of(|| arm(o.cq));
    assert_eq!((made, armed), (0, 0), "an arm");

    to_rts(o.qp);
    let payload = [0x5au8; 64];
    let mut one = [IbvSge {
        addr: payload.as_ptr() as u64,
        length: 64,
        lkey: 0,
    }];
    let mut send = inline_send(100, &mut one);
    let mut bad_send = null_mut();
    assert_eq!(post_send(o.qp, &mut send, &mut bad_send), 0);
    let mut send = inline_send(101, &mut one);
    let (made, posted) = allocations_of(|| post_send(o.qp, &mut send, &mut bad_send));
    assert_eq!((made, posted), (0, 0), "one 64-byte inline send");
    // Three sends chained, each gathering its inline bytes from two SGEs.
    let mut halves = [
        IbvSge {
            addr: payload.as_ptr() as u64,
            length: 32,
            lkey: 0,
        },
        IbvSge {
            addr: payload.as_ptr() as u64 + 32,
            length: 32,
            lkey: 0,
        },
    ];
    let mut chain = [
        inline_send(102, &mut halves),
        inline_send(103, &mut halves),
        inline_send(104, &mut halves),
    ];
    let (second, third): (*mut IbvSendWr, *mut IbvSendWr) = (&mut chain[1], &mut chain[2]);
    chain[0].next = second;
    chain[1].next = third;
    let (made, posted) = allocations_of(|| post_send(o.qp, &mut chain[0], &mut bad_send));
    assert_eq!((made, posted), (0, 0), "three sends gathering inline data");

    // Completions come (the sends, or the receives they filled, or
    // flushed ones once the QP is in the error state): polls that take
    // one CQE each, and polls that find none, allocate nothing.
    to_error(o.qp);
    let mut wc = [IbvWc::default(); 1];
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut taken = 0;
    while taken < 40 && Instant::now() < deadline {
        let (made, got) = allocations_of(|| poll(o.cq, &mut wc));
        assert_eq!(made, 0, "a poll");
        assert!(got == 0 || got == 1, "poll answered {got}");
        if got == 1 {
            assert!(wc[0].wr_id <= 104, "a completion of a request posted");
            taken += 1;
        } else {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    assert_eq!(taken, 40, "40 completions taken one by one within 10 s");
}

/// Posts to an SRQ (`ops.post_srq_recv`: one request, and a list longer
/// than the library converts at once) allocate nothing and really post:
/// the SRQ takes exactly its granted depth, the request past it refused
/// (`ENOMEM`, `*bad_wr` it); once destroyed, its pointer is refused.
#[test]
fn srq_posts_allocate_nothing() {
    let o = objects(8);
    let (mut recv_sge, _) = registered_sge(o.pd, 256);
    let mut init = IbvSrqInitAttr {
        srq_context: null_mut(),
        attr: IbvSrqAttr {
            max_wr: 64,
            max_sge: 2,
            srq_limit: 0,
        },
    };
    // SAFETY: a PD of ours; `init` is valid for reads and writes.
    let srq = unsafe { verbs::ibv_create_srq(o.pd, &mut init) };
    assert!(!srq.is_null());
    let depth = init.attr.max_wr as usize;
    assert!(depth >= 64, "granted {depth}");
    let post = ops().post_srq_recv.expect("ops.post_srq_recv");
    let mut wrs = vec![UNSET_RECV; depth + 1];
    let mut bad = null_mut();
    // Warm-up: anything made once per thread or process on first use.
    recv_list(&mut wrs[..1], &mut recv_sge, 0);
    // SAFETY: a valid list and out-pointer; the SRQ is checked.
    assert_eq!(unsafe { post(srq, &mut wrs[0], &mut bad) }, 0);

    recv_list(&mut wrs[..1], &mut recv_sge, 1);
    // SAFETY: as above.
    let (made, posted) = allocations_of(|| unsafe { post(srq, &mut wrs[0], &mut bad) });
    assert_eq!((made, posted), (0, 0), "one receive to the SRQ");
    recv_list(&mut wrs[..40], &mut recv_sge, 2);
    // SAFETY: as above.
    let (made, posted) = allocations_of(|| unsafe { post(srq, &mut wrs[0], &mut bad) });
    assert_eq!((made, posted), (0, 0), "a list of 40 receives to the SRQ");

    // 42 posted: the rest of the depth fits, the one past it does not.
    let rest = depth - 42;
    recv_list(&mut wrs[..=rest], &mut recv_sge, 42);
    // SAFETY: as above.
    let (made, refused) = allocations_of(|| unsafe { post(srq, &mut wrs[0], &mut bad) });
    assert_eq!((made, refused), (0, libc::ENOMEM), "the depth's end");
    assert_eq!(bad, std::ptr::from_mut(&mut wrs[rest]));

    // SAFETY: an SRQ of ours, no QP on it.
    assert_eq!(unsafe { verbs::ibv_destroy_srq(srq) }, 0);
    recv_list(&mut wrs[..2], &mut recv_sge, 100);
    bad = null_mut();
    // SAFETY: as above.
    assert_eq!(unsafe { post(srq, &mut wrs[0], &mut bad) }, libc::EINVAL);
    assert_eq!(bad, wrs.as_mut_ptr());
}

/// A destroyed QP's and CQ's pointers, and pointers that are not ours, are
/// refused by every data-path entry (`*bad_wr` the first request); a new
/// QP made after the destroy does not take the destroyed one's address.
#[test]
fn destroyed_and_foreign_pointers_are_refused() {
    let o = objects(8);
    let mut sge = IbvSge::default();
    let mut wr = IbvRecvWr {
        wr_id: 7,
        next: null_mut(),
        sg_list: &mut sge,
        num_sge: 0,
    };
    let mut send = inline_send(8, &mut []);
    let mut bad = null_mut();
    let mut bad_send = null_mut();
    // SAFETY: a QP of ours.
    assert_eq!(unsafe { verbs::ibv_destroy_qp(o.qp) }, 0);
    assert_eq!(post_recv(o.qp, &mut wr, &mut bad), libc::EINVAL);
    assert_eq!(bad, std::ptr::from_mut(&mut wr));
    assert_eq!(post_send(o.qp, &mut send, &mut bad_send), libc::EINVAL);
    assert_eq!(bad_send, std::ptr::from_mut(&mut send));
    let again = objects(8);
    assert_ne!(again.qp, o.qp, "a fresh address for the next QP");
    bad = null_mut();
    assert_eq!(post_recv(o.qp, &mut wr, &mut bad), libc::EINVAL);
    assert_eq!(bad, std::ptr::from_mut(&mut wr));

    // SAFETY: a CQ of ours (its QP destroyed).
    assert_eq!(unsafe { verbs::ibv_destroy_cq(o.cq) }, 0);
    let mut wc = [IbvWc::default(); 2];
    assert_eq!(poll(o.cq, &mut wc), -1);
    assert_eq!(arm(o.cq), libc::EINVAL);

    // Not ours: another kind of object, a copy of a live QP's struct, the
    // program's own memory.
    // SAFETY: a live QP of ours, copied bit for bit.
    let mut copy: IbvQp = unsafe { std::ptr::read(again.qp) };
    for qp in [again.pd.cast::<IbvQp>(), &mut copy, null_mut()] {
        bad = null_mut();
        assert_eq!(post_recv(qp, &mut wr, &mut bad), libc::EINVAL);
        assert_eq!(bad, std::ptr::from_mut(&mut wr));
    }
    let mut cq_copy = [0u8; 256];
    for cq in [
        again.qp.cast::<IbvCq>(),
        cq_copy.as_mut_ptr().cast(),
        null_mut(),
    ] {
        assert_eq!(poll(cq, &mut wc), -1);
        assert_eq!(arm(cq), libc::EINVAL);
    }
    // The live ones still answer.
    assert_eq!(poll(again.cq, &mut wc), 0);
    assert_eq!(post_recv(again.qp, &mut wr, &mut bad), 0);
}

/// Four threads post receives and poll while the main thread destroys the
/// QP, then the CQ: every call answers (posted, queue full, or refused),
/// and once a destroy has returned every call on that object is refused.
#[test]
fn posts_and_polls_racing_a_destroy_end_cleanly() {
    let o = objects(16);
    let (whole, mr) = registered_sge(o.pd, 4096);
    let (base, lkey) = (whole.addr, whole.lkey);
    let (qp, cq) = (o.qp as usize, o.cq as usize);
    let qp_gone = Arc::new(AtomicBool::new(false));
    let cq_gone = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..4)
        .map(|t| {
            let (qp_gone, cq_gone, calls) = (
                Arc::clone(&qp_gone),
                Arc::clone(&cq_gone),
                Arc::clone(&calls),
            );
            std::thread::spawn(move || {
                let (qp, cq) = (qp as *mut IbvQp, cq as *mut IbvCq);
                let mut sge = IbvSge {
                    addr: base + t * 64,
                    length: 64,
                    lkey,
                };
                let mut wc = [IbvWc::default(); 4];
                loop {
                    let qp_was_gone = qp_gone.load(Ordering::Acquire);
                    let cq_was_gone = cq_gone.load(Ordering::Acquire);
                    let mut wr = IbvRecvWr {
                        wr_id: t,
                        next: null_mut(),
                        sg_list: &mut sge,
                        num_sge: 1,
                    };
                    let mut bad = null_mut();
                    let posted = post_recv(qp, &mut wr, &mut bad);
                    assert!(
                        [0, libc::ENOMEM, libc::EINVAL].contains(&posted),
                        "post answered {posted}"
                    );
                    if qp_was_gone {
                        assert_eq!(posted, libc::EINVAL, "a post after the destroy");
                    }
                    let polled = poll(cq, &mut wc);
                    assert!((-1..=4).contains(&polled), "poll answered {polled}");
                    if cq_was_gone {
                        assert_eq!(polled, -1, "a poll after the destroy");
                        break;
                    }
                    calls.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let until = |n: usize| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while calls.load(Ordering::Relaxed) < n && Instant::now() < deadline {
            std::thread::yield_now();
        }
    };
    until(200);
    // SAFETY: a QP of ours.
    assert_eq!(unsafe { verbs::ibv_destroy_qp(qp as *mut IbvQp) }, 0);
    qp_gone.store(true, Ordering::Release);
    let seen = calls.load(Ordering::Relaxed);
    until(seen + 200);
    // SAFETY: a CQ of ours, its QP destroyed.
    assert_eq!(unsafe { verbs::ibv_destroy_cq(cq as *mut IbvCq) }, 0);
    cq_gone.store(true, Ordering::Release);
    for worker in workers {
        worker.join().expect("a worker ended cleanly");
    }
    // SAFETY: a region of ours.
    assert_eq!(unsafe { verbs::ibv_dereg_mr(mr) }, 0);
    // SAFETY: a PD of ours, empty now.
    assert_eq!(unsafe { verbs::ibv_dealloc_pd(o.pd) }, 0);
}

/// A UD send finds its address handle by the pointer, with no allocation;
/// once the handle is destroyed, a send naming it is refused (`EINVAL`,
/// `*bad_wr` the request) and nothing is posted.
#[test]
fn ud_sends_reach_their_address_handle_by_pointer() {
    let Objects { pd, qp, .. } = created(IBV_QPT_UD, 16, 1);
    modify(
        qp,
        IbvQpAttr {
            qp_state: IBV_QPS_INIT,
            port_num: 1,
            qkey: 0x1111_1111,
            ..IbvQpAttr::default()
        },
        IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY,
    );
    modify(
        qp,
        IbvQpAttr {
            qp_state: IBV_QPS_RTR,
            ..IbvQpAttr::default()
        },
        IBV_QP_STATE,
    );
    modify(
        qp,
        IbvQpAttr {
            qp_state: IBV_QPS_RTS,
            sq_psn: 1,
            ..IbvQpAttr::default()
        },
        IBV_QP_STATE | IBV_QP_SQ_PSN,
    );
    let mut attr = own_port();
    // SAFETY: a PD of ours; `attr` is valid.
    let ah = unsafe { verbs::ibv_create_ah(pd, &mut attr) };
    assert!(!ah.is_null());
    let payload = [0x3cu8; 64];
    let mut sge = [IbvSge {
        addr: payload.as_ptr() as u64,
        length: 64,
        lkey: 0,
    }];
    // SAFETY: a live QP of ours.
    let own_qpn = unsafe { (*qp).qp_num };
    let mut ud_send = |wr_id| {
        let mut wr = inline_send(wr_id, &mut sge);
        wr.wr.ud = IbvSendWrUd {
            ah,
            remote_qpn: own_qpn,
            remote_qkey: 0x1111_1111,
        };
        wr
    };
    let mut bad = null_mut();
    let mut wr = ud_send(1);
    assert_eq!(post_send(qp, &mut wr, &mut bad), 0);
    let mut wr = ud_send(2);
    let (made, posted) = allocations_of(|| post_send(qp, &mut wr, &mut bad));
    assert_eq!((made, posted), (0, 0), "one UD inline send");

    // SAFETY: an address handle of ours.
    assert_eq!(unsafe { verbs::ibv_destroy_ah(ah) }, 0);
    let mut wr = ud_send(3);
    bad = null_mut();
    assert_eq!(post_send(qp, &mut wr, &mut bad), libc::EINVAL);
    assert_eq!(bad, std::ptr::from_mut(&mut wr));
    // SAFETY: as above: already destroyed.
    assert_eq!(unsafe { verbs::ibv_destroy_ah(ah) }, libc::EINVAL);
}

/// A list longer than the library posts at once: a malformed request in
/// a later chunk is `*bad_wr` with every request before it posted (seen
/// flushed), and a queue filling up in a later chunk names the first
/// request that did not fit.
#[test]
fn a_long_lists_refusal_names_its_request_across_chunks() {
    let o = objects(64);
    let (mut sge, _) = registered_sge(o.pd, 64);
    let mut wrs = [UNSET_RECV; 40];
    recv_list(&mut wrs, &mut sge, 0);
    wrs[29].num_sge = -1;
    let mut bad = null_mut();
    assert_eq!(post_recv(o.qp, &mut wrs[0], &mut bad), libc::EINVAL);
    assert_eq!(bad, std::ptr::from_mut(&mut wrs[29]));
    to_error(o.qp);
    let mut flushed = Vec::new();
    let mut wc = [IbvWc::default(); 16];
    let deadline = Instant::now() + Duration::from_secs(10);
    while flushed.len() < 29 && Instant::now() < deadline {
        let got = poll(o.cq, &mut wc);
        assert!(got >= 0);
        flushed.extend(wc[..got as usize].iter().map(|c| c.wr_id));
        if got == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(poll(o.cq, &mut wc), 0, "nothing past the malformed request");
    assert_eq!(flushed, (0..29).collect::<Vec<u64>>(), "the 29 before it");

    // A queue of `depth` receives: a list of 40 stops at the first that
    // does not fit.
    let fresh = objects(8);
    let mut query = IbvQpAttr::default();
    // SAFETY: a zeroed out-struct: all integers.
    let mut init: IbvQpInitAttr = unsafe { std::mem::zeroed() };
    // SAFETY: a QP of ours; valid out-pointers.
    let queried = unsafe { verbs::ibv_query_qp(fresh.qp, &mut query, 0, &mut init) };
    assert_eq!(queried, 0);
    let depth = query.cap.max_recv_wr as usize;
    assert!(depth < 40, "a queue shorter than the list ({depth})");
    recv_list(&mut wrs, &mut sge, 100);
    bad = null_mut();
    assert_eq!(post_recv(fresh.qp, &mut wrs[0], &mut bad), libc::ENOMEM);
    assert_eq!(bad, std::ptr::from_mut(&mut wrs[depth]));
}
