//! Queue pairs: `ibv_create_qp`, `ibv_modify_qp`, `ibv_query_qp`,
//! `ibv_destroy_qp`, and the context's `ops.post_send` and
//! `ops.post_recv`, over [`ibal_user::SharedQp`] (which owns its PD and
//! CQs; posts go through the linked plugin's fast path, no kernel call).
//!
//! A QP is an `ibv_qp` (in an [`UnsafeCell`]: `ibv_modify_qp` keeps its
//! `state` current, as rdma-core does) followed by the access library's
//! QP and the C objects it names. The `ibv_qp_attr` mask becomes our
//! [`QpModify`] (present attributes form the mask); on the RoCE port the
//! primary path is the AV of `ah_attr` with its GRH, as for
//! `ibv_create_ah`. Work request lists become the plugin's requests; a
//! request that cannot be converted, or that the plugin refuses, is
//! `*bad_wr`, the ones before it posted, with rdma-core's errno values
//! (`EINVAL` for a malformed request, `ENOMEM` for a full queue).

use std::cell::UnsafeCell;
use std::ffi::c_int;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use ib_types::abi::Be32;
use ib_types::access::AccessFlags;
use ib_types::av::AvAttr;
use ib_types::qp::{PathMigState, QpCaps, QpModify, QpState, QpType};
use ib_types::scalars::{Mtu, PortNum, Psn, QKey, Qpn};
use ib_types::uvp::UserSend;
use ib_types::wr::{LKey, RKey, RecvWr, RemoteAddr, SendFlags, SendOp, SendWr, Sge, UdDest};
use ibal_user::{QpInit, SharedQp};
use ibverbs_abi::{
    IBV_QP_ACCESS_FLAGS, IBV_QP_AV, IBV_QP_CAP, IBV_QP_CUR_STATE, IBV_QP_DEST_QPN,
    IBV_QP_EN_SQD_ASYNC_NOTIFY, IBV_QP_MAX_DEST_RD_ATOMIC, IBV_QP_MAX_QP_RD_ATOMIC,
    IBV_QP_MIN_RNR_TIMER, IBV_QP_PATH_MIG_STATE, IBV_QP_PATH_MTU, IBV_QP_PKEY_INDEX, IBV_QP_PORT,
    IBV_QP_QKEY, IBV_QP_RETRY_CNT, IBV_QP_RNR_RETRY, IBV_QP_RQ_PSN, IBV_QP_SQ_PSN, IBV_QP_STATE,
    IBV_QP_TIMEOUT, IBV_QPS_RESET, IBV_QPT_RC, IBV_QPT_UC, IBV_QPT_UD, IBV_WR_ATOMIC_CMP_AND_SWP,
    IBV_WR_ATOMIC_FETCH_AND_ADD, IBV_WR_LOCAL_INV, IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE,
    IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_SEND, IBV_WR_SEND_WITH_IMM, IBV_WR_SEND_WITH_INV, IbvAhAttr,
    IbvGid, IbvGlobalRoute, IbvPd, IbvQp, IbvQpAttr, IbvQpCap, IbvQpInitAttr, IbvRecvWr, IbvSendWr,
    IbvSge,
};

use crate::ah::{av_attr, av_handle_at};
use crate::async_events::ObjectKind;
use crate::cq::{CompletionQueue, cq_at};
use crate::memory::{ProtectionDomain, Registry, lock, pd_for_child, remember, truncated_handle};
use crate::srq::{SharedReceiveQueue, srq_at};
use crate::util::{errno_of, guard, set_errno};

/// A queue pair: rdma-core's `ibv_qp` first, then the access library's
/// QP and the C objects it was made with.
#[repr(C)]
pub(crate) struct QueuePair {
    raw: UnsafeCell<IbvQp>,
    qp: SharedQp,
    qp_type: QpType,
    /// Serializes `ibv_modify_qp`'s write of `raw.state`.
    modifying: Mutex<()>,
    pd: Arc<ProtectionDomain>,
    send_cq: Arc<CompletionQueue>,
    recv_cq: Arc<CompletionQueue>,
    /// The SRQ its receives come from, if any.
    srq: Option<Arc<SharedReceiveQueue>>,
}

// SAFETY: `raw`'s pointers name the context, PD and CQs this QP holds and
// the program's `qp_context` (never dereferenced); its only field written
// after the QP is built is `state`, under `modifying`, as rdma-core writes
// it (programs read it without a lock there too).
unsafe impl Send for QueuePair {}
// SAFETY: as for `Send`.
unsafe impl Sync for QueuePair {}

impl QueuePair {
    fn as_ptr(&self) -> *mut IbvQp {
        self.raw.get()
    }
}

static QPS: Registry<QueuePair> = Mutex::new(None);

fn qp_at(ptr: *const IbvQp) -> Option<Arc<QueuePair>> {
    lock(&QPS).as_ref()?.get(&(ptr as usize)).cloned()
}

fn caps_of(cap: &IbvQpCap) -> QpCaps {
    QpCaps {
        max_send_wr: cap.max_send_wr,
        max_recv_wr: cap.max_recv_wr,
        max_send_sge: cap.max_send_sge,
        max_recv_sge: cap.max_recv_sge,
        max_inline_data: cap.max_inline_data,
    }
}

fn ibv_cap(caps: &QpCaps) -> IbvQpCap {
    IbvQpCap {
        max_send_wr: caps.max_send_wr,
        max_recv_wr: caps.max_recv_wr,
        max_send_sge: caps.max_send_sge,
        max_recv_sge: caps.max_recv_sge,
        max_inline_data: caps.max_inline_data,
    }
}

/// `ibv_create_qp(pd, qp_init_attr)`: an RC, UC or UD QP (`CreateQp`),
/// the granted capacities written back to `qp_init_attr->cap`; with
/// `srq` set, its receives come from that SRQ (the receive capacities
/// asked are ignored, as rdma-core's providers ignore them, and granted
/// as 0). NULL with `errno`: `EINVAL` for a PD, CQ or SRQ not ours, NULL
/// attributes, CQs of another context, an SRQ of another PD;
/// `EOPNOTSUPP` for another QP type; the kernel's answer otherwise.
///
/// # Safety
///
/// `init` is NULL or valid for reads and writes of an `ibv_qp_init_attr`;
/// the other pointers are checked against the live objects.
pub unsafe extern "C" fn ibv_create_qp(pd: *mut IbvPd, init: *mut IbvQpInitAttr) -> *mut IbvQp {
    guard(std::ptr::null_mut(), || {
        // SAFETY: NULL or valid for reads and writes (the contract).
        let Some(init) = (unsafe { init.as_mut() }) else {
            set_errno(libc::EINVAL);
            return std::ptr::null_mut();
        };
        match create_qp(pd, init) {
            Ok(ptr) => ptr,
            Err(errno) => {
                set_errno(errno);
                std::ptr::null_mut()
            }
        }
    })
}

fn create_qp(pd: *mut IbvPd, init: &mut IbvQpInitAttr) -> Result<*mut IbvQp, c_int> {
    let qp_type = match init.qp_type {
        IBV_QPT_RC => QpType::Rc,
        IBV_QPT_UC => QpType::Uc,
        IBV_QPT_UD => QpType::Ud,
        _ => return Err(libc::EOPNOTSUPP),
    };
    let srq = if init.srq.is_null() {
        None
    } else {
        Some(srq_at(init.srq).ok_or(libc::EINVAL)?)
    };
    let send_cq = cq_at(init.send_cq).ok_or(libc::EINVAL)?;
    let recv_cq = cq_at(init.recv_cq).ok_or(libc::EINVAL)?;
    let pd = pd_for_child(pd)?;
    let mut caps = caps_of(&init.cap);
    if srq.is_some() {
        caps.max_recv_wr = 0;
        caps.max_recv_sge = 0;
    }
    let qp_init = QpInit::new(qp_type, caps, init.sq_sig_all != 0);
    let made = match &srq {
        None => SharedQp::new(&pd.pd, &send_cq.cq, &recv_cq.cq, &qp_init),
        Some(srq) => SharedQp::with_srq(&pd.pd, &send_cq.cq, &recv_cq.cq, &srq.srq, &qp_init),
    };
    let qp = match made {
        Ok(qp) => qp,
        Err(error) => {
            pd.children.fetch_sub(1, Ordering::AcqRel);
            return Err(errno_of(&error));
        }
    };
    init.cap = ibv_cap(&qp.caps());
    send_cq.children.fetch_add(1, Ordering::AcqRel);
    recv_cq.children.fetch_add(1, Ordering::AcqRel);
    if let Some(srq) = &srq {
        srq.children.fetch_add(1, Ordering::AcqRel);
    }
    let made = Arc::new(QueuePair {
        raw: UnsafeCell::new(IbvQp {
            context: pd.raw.context,
            qp_context: init.qp_context,
            pd: pd.as_ptr(),
            send_cq: send_cq.as_ptr(),
            recv_cq: recv_cq.as_ptr(),
            srq: srq
                .as_ref()
                .map_or(std::ptr::null_mut(), |srq| srq.as_ptr()),
            handle: truncated_handle(qp.handle()),
            qp_num: qp.qpn(),
            state: IBV_QPS_RESET,
            qp_type: init.qp_type,
            mutex: Default::default(),
            cond: Default::default(),
            events_completed: 0,
        }),
        qp,
        qp_type,
        modifying: Mutex::new(()),
        pd,
        send_cq,
        recv_cq,
        srq,
    });
    let ptr = made.as_ptr();
    let handle = made.qp.handle();
    made.pd
        .context
        .events
        .track(ObjectKind::Qp, handle, ptr as usize);
    remember(&QPS, ptr as usize, made);
    Ok(ptr)
}

/// `ibv_destroy_qp(qp)`: `DestroyQp`, then, as rdma-core, waits until
/// every asynchronous event delivered for it was acknowledged (those not
/// taken yet are dropped). 0, or an errno value: `EINVAL` for a QP not
/// ours (or a second destroy), the kernel's refusal (the QP stays)
/// otherwise.
///
/// # Safety
///
/// None beyond C's: the pointer is checked against the live QPs.
pub unsafe extern "C" fn ibv_destroy_qp(qp: *mut IbvQp) -> c_int {
    guard(libc::EIO, || {
        let Some(found) = lock(&QPS)
            .as_mut()
            .and_then(|qps| qps.remove(&(qp as usize)))
        else {
            return libc::EINVAL;
        };
        if let Err(error) = found.qp.destroy() {
            remember(&QPS, qp as usize, found);
            return errno_of(&error);
        }
        found.pd.context.events.forget(qp as usize);
        found.send_cq.children.fetch_sub(1, Ordering::AcqRel);
        found.recv_cq.children.fetch_sub(1, Ordering::AcqRel);
        if let Some(srq) = &found.srq {
            srq.children.fetch_sub(1, Ordering::AcqRel);
        }
        found.pd.children.fetch_sub(1, Ordering::AcqRel);
        0
    })
}

/// Every `IBV_QP_*` attribute bit this library converts.
const KNOWN_ATTRS: u32 = IBV_QP_STATE
    | IBV_QP_CUR_STATE
    | IBV_QP_EN_SQD_ASYNC_NOTIFY
    | IBV_QP_ACCESS_FLAGS
    | IBV_QP_PKEY_INDEX
    | IBV_QP_PORT
    | IBV_QP_QKEY
    | IBV_QP_AV
    | IBV_QP_PATH_MTU
    | IBV_QP_TIMEOUT
    | IBV_QP_RETRY_CNT
    | IBV_QP_RNR_RETRY
    | IBV_QP_RQ_PSN
    | IBV_QP_MAX_QP_RD_ATOMIC
    | IBV_QP_MIN_RNR_TIMER
    | IBV_QP_SQ_PSN
    | IBV_QP_MAX_DEST_RD_ATOMIC
    | IBV_QP_PATH_MIG_STATE
    | IBV_QP_CAP
    | IBV_QP_DEST_QPN;

fn state_of(code: u32) -> Result<QpState, c_int> {
    u8::try_from(code)
        .ok()
        .and_then(|code| QpState::from_code(code).ok())
        .ok_or(libc::EINVAL)
}

/// Our modify from rdma-core's attributes and mask: `EINVAL` for a value
/// out of range, `EOPNOTSUPP` for an attribute not offered (alternate
/// paths, rate limits, unknown bits).
fn modify_of(pd: &ProtectionDomain, attr: &IbvQpAttr, mask: u32) -> Result<QpModify, c_int> {
    if mask & !KNOWN_ATTRS != 0 {
        return Err(libc::EOPNOTSUPP);
    }
    let has = |bit: u32| mask & bit != 0;
    let bad = |_| libc::EINVAL;
    let mut modify = QpModify::default();
    if has(IBV_QP_STATE) {
        modify.state = Some(state_of(attr.qp_state)?);
    }
    if has(IBV_QP_CUR_STATE) {
        modify.cur_state = Some(state_of(attr.cur_qp_state)?);
    }
    if has(IBV_QP_EN_SQD_ASYNC_NOTIFY) {
        modify.en_sqd_async_notify = Some(attr.en_sqd_async_notify != 0);
    }
    if has(IBV_QP_ACCESS_FLAGS) {
        modify.access = Some(AccessFlags::from_bits(attr.qp_access_flags).ok_or(libc::EINVAL)?);
    }
    if has(IBV_QP_PKEY_INDEX) {
        modify.pkey_index = Some(attr.pkey_index);
    }
    if has(IBV_QP_PORT) {
        modify.port = Some(PortNum::new(attr.port_num).map_err(bad)?);
    }
    if has(IBV_QP_QKEY) {
        modify.qkey = Some(QKey::new(attr.qkey));
    }
    if has(IBV_QP_AV) {
        modify.av = Some(av_attr(pd, &attr.ah_attr)?);
    }
    if has(IBV_QP_PATH_MTU) {
        let code = u8::try_from(attr.path_mtu).map_err(|_| libc::EINVAL)?;
        modify.path_mtu = Some(Mtu::from_code(code).map_err(bad)?);
    }
    if has(IBV_QP_TIMEOUT) {
        modify.timeout = Some(attr.timeout);
    }
    if has(IBV_QP_RETRY_CNT) {
        modify.retry_cnt = Some(attr.retry_cnt);
    }
    if has(IBV_QP_RNR_RETRY) {
        modify.rnr_retry = Some(attr.rnr_retry);
    }
    if has(IBV_QP_RQ_PSN) {
        modify.rq_psn = Some(Psn::new(attr.rq_psn).map_err(bad)?);
    }
    if has(IBV_QP_MAX_QP_RD_ATOMIC) {
        modify.max_rd_atomic = Some(attr.max_rd_atomic);
    }
    if has(IBV_QP_MIN_RNR_TIMER) {
        modify.min_rnr_timer = Some(attr.min_rnr_timer);
    }
    if has(IBV_QP_SQ_PSN) {
        modify.sq_psn = Some(Psn::new(attr.sq_psn).map_err(bad)?);
    }
    if has(IBV_QP_MAX_DEST_RD_ATOMIC) {
        modify.max_dest_rd_atomic = Some(attr.max_dest_rd_atomic);
    }
    if has(IBV_QP_PATH_MIG_STATE) {
        let code = u8::try_from(attr.path_mig_state).map_err(|_| libc::EINVAL)?;
        modify.path_mig_state = Some(PathMigState::from_code(code).map_err(bad)?);
    }
    if has(IBV_QP_CAP) {
        modify.cap = Some(caps_of(&attr.cap));
    }
    if has(IBV_QP_DEST_QPN) {
        modify.dest_qpn = Some(Qpn::new(attr.dest_qp_num).map_err(bad)?);
    }
    Ok(modify)
}

/// `ibv_modify_qp(qp, attr, attr_mask)`: `ModifyQp` with the attributes
/// the mask names; `qp->state` follows. 0, or an errno value: `EINVAL` for
/// a QP not ours, NULL `attr`, a value out of range or a transition the
/// kernel refuses; `EOPNOTSUPP` for attributes not offered.
///
/// # Safety
///
/// `attr` is NULL or valid for reads of an `ibv_qp_attr`.
pub unsafe extern "C" fn ibv_modify_qp(qp: *mut IbvQp, attr: *mut IbvQpAttr, mask: c_int) -> c_int {
    guard(libc::EIO, || {
        let Some(found) = qp_at(qp) else {
            return libc::EINVAL;
        };
        // SAFETY: NULL or valid for reads (the contract); copied at once.
        let Some(attr) = (unsafe { attr.as_ref() }).copied() else {
            return libc::EINVAL;
        };
        let modify = match modify_of(&found.pd, &attr, mask as u32) {
            Ok(modify) => modify,
            Err(errno) => return errno,
        };
        let _one_at_a_time = found
            .modifying
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Err(error) = found.qp.modify(&modify) {
            return errno_of(&error);
        }
        if let Some(state) = modify.state {
            // SAFETY: `raw` is ours; `state` is written only here, under
            // `modifying`, as rdma-core writes it.
            unsafe { (*found.raw.get()).state = u32::from(state.code()) };
        }
        0
    })
}

/// rdma-core's address from ours.
fn ibv_ah_attr(av: &AvAttr) -> IbvAhAttr {
    let grh = av
        .grh
        .map_or_else(IbvGlobalRoute::default, |grh| IbvGlobalRoute {
            dgid: IbvGid {
                raw: grh.dgid.octets(),
            },
            flow_label: grh.flow_label,
            sgid_index: grh.sgid_index,
            hop_limit: grh.hop_limit,
            traffic_class: grh.traffic_class,
        });
    IbvAhAttr {
        grh,
        dlid: av.dlid.get(),
        sl: av.sl,
        src_path_bits: av.path_bits,
        static_rate: av.static_rate,
        is_global: u8::from(av.grh.is_some()),
        port_num: av.port.get(),
    }
}

/// `ibv_query_qp(qp, attr, attr_mask, init_attr)`: `QueryQp`, every
/// attribute filled whatever the mask (as rdma-core's kernel answers),
/// and the creation attributes. 0, or an errno value (`EINVAL` for a QP
/// not ours or NULL out-pointers).
///
/// # Safety
///
/// `attr` and `init` are NULL or valid for writes.
pub unsafe extern "C" fn ibv_query_qp(
    qp: *mut IbvQp,
    attr: *mut IbvQpAttr,
    _mask: c_int,
    init: *mut IbvQpInitAttr,
) -> c_int {
    guard(libc::EIO, || {
        let Some(found) = qp_at(qp) else {
            return libc::EINVAL;
        };
        if attr.is_null() || init.is_null() {
            return libc::EINVAL;
        }
        let answer = match found.qp.query() {
            Ok(answer) => answer,
            Err(error) => return errno_of(&error),
        };
        let a = &answer.attr;
        let state = u32::from(answer.state.code());
        let out = IbvQpAttr {
            qp_state: state,
            cur_qp_state: state,
            path_mtu: a.path_mtu.map_or(0, |m| u32::from(m.code())),
            path_mig_state: a.path_mig_state.map_or(0, |m| u32::from(m.code())),
            qkey: a.qkey.map_or(0, QKey::get),
            rq_psn: a.rq_psn.map_or(0, Psn::get),
            sq_psn: a.sq_psn.map_or(0, Psn::get),
            dest_qp_num: a.dest_qpn.map_or(0, Qpn::get),
            qp_access_flags: a.access.map_or(0, |f| f.bits()),
            cap: ibv_cap(&answer.caps),
            ah_attr: a.av.as_ref().map(ibv_ah_attr).unwrap_or_default(),
            alt_ah_attr: IbvAhAttr::default(),
            pkey_index: a.pkey_index.unwrap_or(0),
            alt_pkey_index: 0,
            en_sqd_async_notify: u8::from(a.en_sqd_async_notify.unwrap_or(false)),
            sq_draining: 0,
            max_rd_atomic: a.max_rd_atomic.unwrap_or(0),
            max_dest_rd_atomic: a.max_dest_rd_atomic.unwrap_or(0),
            min_rnr_timer: a.min_rnr_timer.unwrap_or(0),
            port_num: a.port.map_or(0, PortNum::get),
            timeout: a.timeout.unwrap_or(0),
            retry_cnt: a.retry_cnt.unwrap_or(0),
            rnr_retry: a.rnr_retry.unwrap_or(0),
            alt_port_num: 0,
            alt_timeout: 0,
            rate_limit: 0,
        };
        // SAFETY: `raw` is ours; read only.
        let raw = unsafe { &*found.raw.get() };
        let created = IbvQpInitAttr {
            qp_context: raw.qp_context,
            send_cq: raw.send_cq,
            recv_cq: raw.recv_cq,
            srq: raw.srq,
            cap: ibv_cap(&answer.caps),
            qp_type: raw.qp_type,
            sq_sig_all: c_int::from(answer.sq_sig_all),
        };
        // SAFETY: non-NULL (checked) and valid for writes (the contract).
        unsafe { attr.write(out) };
        // SAFETY: as `attr`.
        unsafe { init.write(created) };
        0
    })
}

/// Our SGEs from a request's list.
///
/// # Safety
/// `list` is valid for reads of `count` entries when `count` > 0.
pub(crate) unsafe fn sges_of(list: *const IbvSge, count: c_int) -> Result<Vec<Sge>, c_int> {
    let count = usize::try_from(count).map_err(|_| libc::EINVAL)?;
    if count == 0 {
        return Ok(Vec::new());
    }
    if list.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: `count` entries at `list` (the contract).
    let list = unsafe { std::slice::from_raw_parts(list, count) };
    Ok(list
        .iter()
        .map(|s| Sge::new(s.addr, s.length, LKey::new(s.lkey)))
        .collect())
}

/// One send request converted, with the storage its borrows need.
struct SendParts {
    wr_id: u64,
    op: SendOp,
    flags: SendFlags,
    sges: Vec<Sge>,
    inline: Option<Vec<u8>>,
    ud: Option<UdDest>,
}

/// Converts one `ibv_send_wr`: `EINVAL` when it is malformed or names an
/// operation or AH this library does not have.
///
/// # Safety
/// `wr` is a valid request whose lists and (inline) buffers are readable,
/// `ibv_post_send`'s contract.
unsafe fn send_parts(wr: &IbvSendWr, qp_type: QpType) -> Result<SendParts, c_int> {
    let flags = SendFlags::from_bits(wr.send_flags).ok_or(libc::EINVAL)?;
    // SAFETY: the caller's contract.
    let sges = unsafe { sges_of(wr.sg_list, wr.num_sge) }?;
    // Each union member is read only for the opcodes that name it (the
    // others may be left uninitialized by the program).
    let remote = || {
        // SAFETY: the member RDMA opcodes name (rdma-core's contract).
        let rdma = unsafe { wr.wr.rdma };
        RemoteAddr {
            addr: rdma.remote_addr,
            rkey: RKey::new(rdma.rkey),
        }
    };
    let atomic = || {
        // SAFETY: the member atomic opcodes name.
        let atomic = unsafe { wr.wr.atomic };
        let remote = RemoteAddr {
            addr: atomic.remote_addr,
            rkey: RKey::new(atomic.rkey),
        };
        (remote, atomic.compare_add, atomic.swap)
    };
    // `imm_data` is big-endian in memory (`__be32`).
    // SAFETY: the member the immediate opcodes name.
    let imm = || Be32::new(u32::from_be(unsafe { wr.imm.imm_data }));
    // SAFETY: the member the invalidate opcodes name.
    let invalidate = || RKey::new(unsafe { wr.imm.invalidate_rkey });
    let op = match wr.opcode {
        IBV_WR_SEND => SendOp::Send,
        IBV_WR_SEND_WITH_IMM => SendOp::SendWithImm { imm: imm() },
        IBV_WR_SEND_WITH_INV => SendOp::SendWithInvalidate { rkey: invalidate() },
        IBV_WR_RDMA_WRITE => SendOp::RdmaWrite { remote: remote() },
        IBV_WR_RDMA_WRITE_WITH_IMM => SendOp::RdmaWriteWithImm {
            remote: remote(),
            imm: imm(),
        },
        IBV_WR_RDMA_READ => SendOp::RdmaRead { remote: remote() },
        IBV_WR_ATOMIC_CMP_AND_SWP => {
            let (remote, compare, swap) = atomic();
            SendOp::CompareSwap {
                remote,
                compare,
                swap,
            }
        }
        IBV_WR_ATOMIC_FETCH_AND_ADD => {
            let (remote, add, _) = atomic();
            SendOp::FetchAdd { remote, add }
        }
        IBV_WR_LOCAL_INV => SendOp::LocalInvalidate { rkey: invalidate() },
        _ => return Err(libc::EINVAL),
    };
    let ud = if qp_type == QpType::Ud {
        // SAFETY: the member a UD QP's requests fill.
        let ud = unsafe { wr.wr.ud };
        Some(UdDest {
            av: av_handle_at(ud.ah).ok_or(libc::EINVAL)?,
            remote_qpn: Qpn::new(ud.remote_qpn).map_err(|_| libc::EINVAL)?,
            remote_qkey: QKey::new(ud.remote_qkey),
        })
    } else {
        None
    };
    let inline = if flags.contains(SendFlags::INLINE) {
        let mut bytes = Vec::new();
        for sge in &sges {
            let len = sge.length.get() as usize;
            if len == 0 {
                continue;
            }
            let at = sge.addr.get() as usize as *const u8;
            if at.is_null() {
                return Err(libc::EINVAL);
            }
            // SAFETY: an inline send's SGEs name readable bytes of the
            // program for the duration of the post (the contract).
            bytes.extend_from_slice(unsafe { std::slice::from_raw_parts(at, len) });
        }
        Some(bytes)
    } else {
        None
    };
    Ok(SendParts {
        wr_id: wr.wr_id,
        op,
        flags,
        sges,
        inline,
        ud,
    })
}

/// Sets `*bad` (if not NULL) to `wr`.
///
/// # Safety
/// `bad` is NULL or valid for writes.
pub(crate) unsafe fn set_bad<T>(bad: *mut *mut T, wr: *mut T) {
    if !bad.is_null() {
        // SAFETY: the contract.
        unsafe { bad.write(wr) };
    }
}

/// How a post of the list starting at `first` ends: the access library's
/// refusal (`*bad_wr` the first request it did not post, of those in
/// `ptrs`), else the first request that could not be converted
/// (`refused`), else 0.
///
/// # Safety
///
/// `bad_wr` is NULL or valid for a write.
pub(crate) unsafe fn post_outcome<T>(
    posting: Result<(), ibal_user::Error>,
    ptrs: &[*mut T],
    first: *mut T,
    refused: Option<(*mut T, c_int)>,
    bad_wr: *mut *mut T,
) -> c_int {
    if let Err(error) = posting {
        let posted = match &error {
            ibal_user::Error::Refused { posted, .. } => *posted,
            _ => 0,
        };
        // SAFETY: the contract.
        unsafe { set_bad(bad_wr, ptrs.get(posted).copied().unwrap_or(first)) };
        return errno_of(&error);
    }
    match refused {
        Some((at, errno)) => {
            // SAFETY: the contract.
            unsafe { set_bad(bad_wr, at) };
            errno
        }
        None => 0,
    }
}

/// `ops.post_send` (`ibv_post_send`): the list's requests, posted in user
/// mode with one doorbell. 0, or an errno value with `*bad_wr` the first
/// request not posted (those before it were): `EINVAL` for a malformed
/// request, an unknown opcode or AH, or a QP not ours; the plugin's
/// refusal otherwise (`ENOMEM` for a full queue).
///
/// # Safety
///
/// rdma-core's: `wr` is a valid list; `bad_wr` is valid for a write.
pub(crate) unsafe extern "C" fn post_send(
    qp: *mut IbvQp,
    wr: *mut IbvSendWr,
    bad_wr: *mut *mut IbvSendWr,
) -> c_int {
    guard(libc::EIO, || {
        let Some(found) = qp_at(qp) else {
            // SAFETY: the contract.
            unsafe { set_bad(bad_wr, wr) };
            return libc::EINVAL;
        };
        let mut ptrs = Vec::new();
        let mut parts = Vec::new();
        let mut refused = None;
        let mut at = wr;
        while !at.is_null() {
            // SAFETY: a valid list (the contract).
            let one = unsafe { &*at };
            // SAFETY: as above.
            match unsafe { send_parts(one, found.qp_type) } {
                Ok(p) => {
                    parts.push(p);
                    ptrs.push(at);
                }
                Err(errno) => {
                    refused = Some((at, errno));
                    break;
                }
            }
            at = one.next;
        }
        let requests: Vec<UserSend<'_>> = parts
            .iter()
            .map(|p| UserSend {
                wr: SendWr {
                    wr_id: p.wr_id,
                    op: p.op,
                    flags: p.flags,
                    sg_list: &p.sges,
                    ud: p.ud,
                },
                inline: p.inline.as_deref(),
            })
            .collect();
        let posting = if requests.is_empty() {
            Ok(())
        } else {
            found.qp.post_send(&requests).map(drop)
        };
        // SAFETY: the contract.
        unsafe { post_outcome(posting, &ptrs, wr, refused, bad_wr) }
    })
}

/// `ops.post_recv` (`ibv_post_recv`): as [`post_send`] for receives; a
/// QP on an SRQ has no receive queue (`EINVAL`, `*bad_wr` the first
/// request: post to the SRQ, `crate::srq`).
///
/// # Safety
///
/// rdma-core's: `wr` is a valid list; `bad_wr` is valid for a write.
pub(crate) unsafe extern "C" fn post_recv(
    qp: *mut IbvQp,
    wr: *mut IbvRecvWr,
    bad_wr: *mut *mut IbvRecvWr,
) -> c_int {
    guard(libc::EIO, || {
        let Some(found) = qp_at(qp) else {
            // SAFETY: the contract.
            unsafe { set_bad(bad_wr, wr) };
            return libc::EINVAL;
        };
        let mut ptrs = Vec::new();
        let mut lists = Vec::new();
        let mut refused = None;
        let mut at = wr;
        while !at.is_null() {
            // SAFETY: a valid list (the contract).
            let one = unsafe { &*at };
            // SAFETY: as above.
            match unsafe { sges_of(one.sg_list, one.num_sge) } {
                Ok(sges) => {
                    lists.push((one.wr_id, sges));
                    ptrs.push(at);
                }
                Err(errno) => {
                    refused = Some((at, errno));
                    break;
                }
            }
            at = one.next;
        }
        let requests: Vec<RecvWr<'_>> = lists
            .iter()
            .map(|(wr_id, sges)| RecvWr {
                wr_id: *wr_id,
                sg_list: sges,
            })
            .collect();
        let posting = if requests.is_empty() {
            Ok(())
        } else {
            found.qp.post_recv(&requests).map(drop)
        };
        // SAFETY: the contract.
        unsafe { post_outcome(posting, &ptrs, wr, refused, bad_wr) }
    })
}
