//! Queue pairs: `ibv_create_qp`, `ibv_modify_qp`, `ibv_query_qp`,
//! `ibv_destroy_qp`, and the context's `ops.post_send` and
//! `ops.post_recv`, over [`ibal_user::SharedQp`] (which owns its PD and
//! CQs; posts go through the linked plugin's fast path, no kernel call).
//!
//! A QP's `ibv_qp` is the front of its slot in the QP table
//! ([`crate::slots`]: `ibv_modify_qp` keeps its `state` current, as
//! rdma-core does), and the slot holds the access library's QP and the C
//! objects it names (CQs, and the SRQ a QP made with one receives from,
//! `crate::srq`); a post reaches it from the program's pointer with no
//! lock or lookup. The `ibv_qp_attr` mask becomes our [`QpModify`]
//! (present attributes form the mask); on the RoCE port the primary path
//! is the AV of `ah_attr` with its GRH, as for `ibv_create_ah`. Work
//! request lists become the plugin's requests with no heap allocation
//! (SGE lists read in place, at most [`CHUNK`] requests per call into the
//! plugin, one request straight); a request that cannot be converted, or
//! that the plugin refuses, is `*bad_wr`, the ones before it posted, with
//! rdma-core's errno values (`EINVAL` for a malformed request, `ENOMEM`
//! for a full queue).

use std::ffi::c_int;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use smallvec::SmallVec;
use zerocopy::FromBytes;

use ib_types::abi::Be32;
use ib_types::access::AccessFlags;
use ib_types::av::AvAttr;
use ib_types::qp::{PathMigState, QpCaps, QpModify, QpState, QpType};
use ib_types::scalars::{Mtu, PortNum, Psn, QKey, Qpn};
use ib_types::uvp::UserSend;
use ib_types::wr::{RKey, RecvWr, RemoteAddr, SendFlags, SendOp, SendWr, Sge, UdDest};
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
use crate::memory::{ProtectionDomain, pd_for_child, truncated_handle};
use crate::slots::{Lease, Table};
use crate::srq::{SharedReceiveQueue, srq_at};
use crate::util::{errno_of, guard, set_errno};

/// A queue pair: rdma-core's `ibv_qp` first, then the access library's
/// QP and the C objects it was made with.
pub(crate) struct QueuePair {
    /// Its slot in [`QPS`], where the program's `ibv_qp` is.
    raw: Lease<IbvQp, QueuePair>,
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

// SAFETY: `raw`'s pointers name the context, PD, CQs and SRQ this QP holds and
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

/// The live QPs, found by the `ibv_qp` pointer ([`crate::slots`]).
static QPS: Table<IbvQp, QueuePair> = Table::new();

fn qp_at(ptr: *const IbvQp) -> Option<Arc<QueuePair>> {
    QPS.get(ptr)
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
    let raw = QPS.reserve(IbvQp {
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
    });
    let Some(raw) = raw else {
        // Dropping it destroys it.
        drop(qp);
        pd.children.fetch_sub(1, Ordering::AcqRel);
        return Err(libc::ENOMEM);
    };
    init.cap = ibv_cap(&qp.caps());
    send_cq.children.fetch_add(1, Ordering::AcqRel);
    recv_cq.children.fetch_add(1, Ordering::AcqRel);
    if let Some(srq) = &srq {
        srq.children.fetch_add(1, Ordering::AcqRel);
    }
    let made = Arc::new(QueuePair {
        raw,
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
    QPS.publish(&made.raw, Arc::clone(&made));
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
        // Waits for the posts inside it; every later one is refused.
        let Some(found) = QPS.take(qp) else {
            return libc::EINVAL;
        };
        if let Err(error) = found.qp.destroy() {
            QPS.publish(&found.raw, Arc::clone(&found));
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
        // A QP's rights are the remote ones (IBA's Modify QP); the region-only
        // bits (LOCAL_WRITE, MW_BIND) are accepted and ignored, as
        // rdma-core's providers do (perftest's send tests ask LOCAL_WRITE).
        let asked = AccessFlags::from_bits(attr.qp_access_flags).ok_or(libc::EINVAL)?;
        modify.access = Some(asked & AccessFlags::REMOTE);
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

/// Requests converted and posted per call into the plugin (one doorbell
/// each): a longer list is posted this many at a time, so converting it
/// needs no heap.
const CHUNK: usize = 16;
/// Bytes of inline data gathered from several SGEs per chunk (a request
/// whose inline data is one SGE's bytes is passed as they are): a
/// request that does not fit ends the chunk; one whose data alone is
/// larger (past every device's inline limit: the plugin refuses it) is
/// gathered on the heap.
const CHUNK_INLINE: usize = 1024;

// rdma-core's `ibv_sge` (host-order `u64`, `u32`, `u32`) and our `Sge`
// (little-endian fields) have the same bytes on a little-endian machine,
// which every target of this library is: a list is read in place.
#[cfg(not(target_endian = "little"))]
compile_error!("ibverbs-compat reads rdma-core's ibv_sge lists in place: little-endian only");

/// A request's SGE list, read in place: `EINVAL` for a negative count or
/// a NULL list with entries.
///
/// # Safety
/// `list` is valid for reads of `count` entries when `count` > 0, for
/// `'a` (the post's duration, `ibv_post_send`'s contract).
unsafe fn sges_of<'a>(list: *const IbvSge, count: c_int) -> Result<&'a [Sge], c_int> {
    let count = usize::try_from(count).map_err(|_| libc::EINVAL)?;
    if count == 0 {
        return Ok(&[]);
    }
    if list.is_null() {
        return Err(libc::EINVAL);
    }
    let len = count.checked_mul(size_of::<IbvSge>()).ok_or(libc::EINVAL)?;
    // SAFETY: `count` entries at `list` (the contract), as bytes.
    let bytes = unsafe { std::slice::from_raw_parts(list.cast::<u8>(), len) };
    // `Sge` is 16 bytes of alignment 1, any bytes valid: never refused.
    <[Sge]>::ref_from_bytes(bytes).map_err(|_| libc::EINVAL)
}

/// Where an inline send's bytes are.
enum InlineBytes<'a> {
    /// None (not inline), or one SGE's bytes, read in place.
    InPlace(Option<&'a [u8]>),
    /// Gathered from several SGEs into the chunk's buffer, at this range.
    Gathered(Range<usize>),
}

/// One send request converted (its SGEs read in place).
struct SendParts<'a> {
    wr: SendWr<'a>,
    inline: InlineBytes<'a>,
}

/// The program's bytes an SGE of an inline send names: `EINVAL` for a
/// NULL address with bytes.
///
/// # Safety
/// The SGE names readable bytes for `'a` (the contract).
unsafe fn inline_bytes<'a>(sge: &Sge) -> Result<&'a [u8], c_int> {
    let len = sge.length.get() as usize;
    if len == 0 {
        return Ok(&[]);
    }
    let at = sge.addr.get() as usize as *const u8;
    if at.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: an inline send's SGEs name readable bytes of the program for
    // the duration of the post (the contract).
    Ok(unsafe { std::slice::from_raw_parts(at, len) })
}

/// Converts one `ibv_send_wr`, gathering the inline data of several SGEs
/// into `gathered`: `EINVAL` when it is malformed or names an operation
/// or AH this library does not have; `Ok(None)` when its data is to be
/// gathered and there is no buffer, or its gathered data does not fit the
/// chunk's buffer and the chunk already holds requests (it starts the
/// next chunk).
///
/// # Safety
/// `wr` is a valid request whose lists and (inline) buffers are readable
/// for `'a`, `ibv_post_send`'s contract.
unsafe fn send_parts<'a>(
    wr: &'a IbvSendWr,
    qp_type: QpType,
    gathered: Option<&mut SmallVec<[u8; CHUNK_INLINE]>>,
    chunk_empty: bool,
) -> Result<Option<SendParts<'a>>, c_int> {
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
    let inline = if !flags.contains(SendFlags::INLINE) {
        InlineBytes::InPlace(None)
    } else if sges.iter().filter(|s| s.length.get() != 0).count() <= 1 {
        let mut bytes: &[u8] = &[];
        for sge in sges {
            // SAFETY: the caller's contract.
            let one = unsafe { inline_bytes(sge) }?;
            if !one.is_empty() {
                bytes = one;
            }
        }
        InlineBytes::InPlace(Some(bytes))
    } else {
        let Some(gathered) = gathered else {
            return Ok(None);
        };
        let total: usize = sges.iter().map(|s| s.length.get() as usize).sum();
        if !chunk_empty && gathered.len() + total > CHUNK_INLINE {
            return Ok(None);
        }
        let start = gathered.len();
        for sge in sges {
            // SAFETY: the caller's contract.
            gathered.extend_from_slice(unsafe { inline_bytes(sge) }?);
        }
        InlineBytes::Gathered(start..gathered.len())
    };
    Ok(Some(SendParts {
        wr: SendWr {
            wr_id: wr.wr_id,
            op,
            flags,
            sg_list: sges,
            ud,
        },
        inline,
    }))
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

/// Posts one chunk of converted requests (`ptrs` their requests): 0, or
/// the plugin's refusal as an errno value with `*bad_wr` the first
/// request it did not post.
///
/// # Safety
///
/// `bad_wr` is NULL or valid for a write.
unsafe fn post_chunk<T>(
    posting: Result<usize, ibal_user::Error>,
    ptrs: &[*mut T],
    bad_wr: *mut *mut T,
) -> c_int {
    match posting {
        Ok(_) => 0,
        Err(error) => {
            let posted = match &error {
                ibal_user::Error::Refused { posted, .. } => *posted,
                _ => 0,
            };
            if let Some(&at) = ptrs.get(posted).or(ptrs.first()) {
                // SAFETY: the contract.
                unsafe { set_bad(bad_wr, at) };
            }
            errno_of(&error)
        }
    }
}

/// `ops.post_send` (`ibv_post_send`): the list's requests, posted in user
/// mode, [`CHUNK`] at a time (one doorbell each), with no lock, lookup or
/// heap allocation on the way (the QP found by its pointer,
/// [`crate::slots`]). 0, or an errno value with `*bad_wr` the first
/// request not posted (those before it were): `EINVAL` for a malformed
/// request, an unknown opcode or AH, or a QP not ours or destroyed; the
/// plugin's refusal otherwise (`ENOMEM` for a full queue).
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
        // SAFETY: the contract, passed on.
        let posted = QPS.with(qp, |found| unsafe { post_send_list(found, wr, bad_wr) });
        posted.unwrap_or_else(|| {
            // SAFETY: the contract.
            unsafe { set_bad(bad_wr, wr) };
            libc::EINVAL
        })
    })
}

/// [`post_send`] on a live QP.
///
/// # Safety
///
/// As [`post_send`]'s.
unsafe fn post_send_list(
    found: &QueuePair,
    first: *mut IbvSendWr,
    bad_wr: *mut *mut IbvSendWr,
) -> c_int {
    // SAFETY: NULL or a valid request (the contract).
    if let Some(one) = unsafe { first.as_ref() }
        && one.next.is_null()
    {
        // One request, its inline data (if any) in place: no chunk.
        // SAFETY: as above.
        match unsafe { send_parts(one, found.qp_type, None, true) } {
            Ok(Some(p)) => {
                let request = UserSend {
                    wr: p.wr,
                    inline: match p.inline {
                        InlineBytes::InPlace(bytes) => bytes,
                        InlineBytes::Gathered(_) => None,
                    },
                };
                let posting = found.qp.post_send(std::slice::from_ref(&request));
                // SAFETY: the contract.
                return unsafe { post_chunk(posting, &[first], bad_wr) };
            }
            Ok(None) => {}
            Err(errno) => {
                // SAFETY: the contract.
                unsafe { set_bad(bad_wr, first) };
                return errno;
            }
        }
    }
    let mut at = first;
    while !at.is_null() {
        let mut ptrs: SmallVec<[*mut IbvSendWr; CHUNK]> = SmallVec::new();
        let mut parts: SmallVec<[SendParts<'_>; CHUNK]> = SmallVec::new();
        let mut gathered: SmallVec<[u8; CHUNK_INLINE]> = SmallVec::new();
        let mut refused = None;
        while !at.is_null() && ptrs.len() < CHUNK {
            // SAFETY: a valid list (the contract).
            let one = unsafe { &*at };
            let chunk_empty = ptrs.is_empty();
            // SAFETY: as above.
            match unsafe { send_parts(one, found.qp_type, Some(&mut gathered), chunk_empty) } {
                Ok(Some(p)) => {
                    parts.push(p);
                    ptrs.push(at);
                    at = one.next;
                }
                Ok(None) => break,
                Err(errno) => {
                    refused = Some((at, errno));
                    break;
                }
            }
        }
        if !parts.is_empty() {
            let mut requests: SmallVec<[UserSend<'_>; CHUNK]> = SmallVec::new();
            for p in &parts {
                requests.push(UserSend {
                    wr: p.wr,
                    inline: match &p.inline {
                        InlineBytes::InPlace(bytes) => *bytes,
                        InlineBytes::Gathered(range) => gathered.get(range.clone()),
                    },
                });
            }
            // SAFETY: the contract.
            let errno = unsafe { post_chunk(found.qp.post_send(&requests), &ptrs, bad_wr) };
            if errno != 0 {
                return errno;
            }
        }
        if let Some((at, errno)) = refused {
            // SAFETY: the contract.
            unsafe { set_bad(bad_wr, at) };
            return errno;
        }
    }
    0
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
        // SAFETY: the contract, passed on.
        let posted = QPS.with(qp, |found| unsafe {
            post_recv_list(wr, bad_wr, |requests| found.qp.post_recv(requests))
        });
        posted.unwrap_or_else(|| {
            // SAFETY: the contract.
            unsafe { set_bad(bad_wr, wr) };
            libc::EINVAL
        })
    })
}

/// A receive list converted and handed to `post` (a live QP's receive
/// queue, or an SRQ's: `crate::srq`), [`CHUNK`] requests at a time, with
/// no heap allocation: 0, or an errno value with `*bad_wr` the first
/// request not posted.
///
/// # Safety
///
/// As [`post_recv`]'s.
pub(crate) unsafe fn post_recv_list(
    first: *mut IbvRecvWr,
    bad_wr: *mut *mut IbvRecvWr,
    post: impl Fn(&[RecvWr<'_>]) -> Result<usize, ibal_user::Error>,
) -> c_int {
    // SAFETY: NULL or a valid request (the contract).
    if let Some(one) = unsafe { first.as_ref() }
        && one.next.is_null()
    {
        // One request: no chunk.
        // SAFETY: as above.
        return match unsafe { sges_of(one.sg_list, one.num_sge) } {
            Ok(sg_list) => {
                let request = RecvWr {
                    wr_id: one.wr_id,
                    sg_list,
                };
                let posting = post(std::slice::from_ref(&request));
                // SAFETY: the contract.
                unsafe { post_chunk(posting, &[first], bad_wr) }
            }
            Err(errno) => {
                // SAFETY: the contract.
                unsafe { set_bad(bad_wr, first) };
                errno
            }
        };
    }
    let mut at = first;
    while !at.is_null() {
        let mut ptrs: SmallVec<[*mut IbvRecvWr; CHUNK]> = SmallVec::new();
        let mut requests: SmallVec<[RecvWr<'_>; CHUNK]> = SmallVec::new();
        let mut refused = None;
        while !at.is_null() && ptrs.len() < CHUNK {
            // SAFETY: a valid list (the contract).
            let one = unsafe { &*at };
            // SAFETY: as above.
            match unsafe { sges_of(one.sg_list, one.num_sge) } {
                Ok(sg_list) => {
                    requests.push(RecvWr {
                        wr_id: one.wr_id,
                        sg_list,
                    });
                    ptrs.push(at);
                    at = one.next;
                }
                Err(errno) => {
                    refused = Some((at, errno));
                    break;
                }
            }
        }
        if !requests.is_empty() {
            // SAFETY: the contract.
            let errno = unsafe { post_chunk(post(&requests), &ptrs, bad_wr) };
            if errno != 0 {
                return errno;
            }
        }
        if let Some((at, errno)) = refused {
            // SAFETY: the contract.
            unsafe { set_bad(bad_wr, at) };
            return errno;
        }
    }
    0
}
